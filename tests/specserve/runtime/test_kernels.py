"""Packed oneDNN linear layers: the same products as torch's own kernel, chosen by device and dtype."""

from __future__ import annotations

import pytest
import torch
from tiny_llama import tiny_llama
from torch import nn

from specserve.errors import FailedPrecondition
from specserve.runtime import kernels
from specserve.runtime.kernels import (
    FusedPart,
    LinearKernel,
    PackedLinear,
    apply_linear_kernel,
    model_linear_kernel,
    resolve_kernel,
)

needs_onednn = pytest.mark.skipif(not kernels.onednn_available(), reason="torch built without oneDNN")
needs_onednn_bf16 = pytest.mark.skipif(
    not (kernels.onednn_available() and kernels.onednn_packs(torch.bfloat16)),
    reason="this CPU's oneDNN has no bf16 path (no AVX-512 or AVX-NE-CONVERT)",
)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 16, 33, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_agrees_with_f_linear_for_every_row_count(rows, bias):
    generator = torch.Generator().manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias).requires_grad_(False)
    packed = PackedLinear.from_linear(linear)
    x = torch.randn(rows, 96, generator=generator)  # [M, in]
    torch.testing.assert_close(packed(x), linear(x), atol=2e-5, rtol=1e-5)
    # leading dims are kept: [B, S, in] -> [B, S, out], and a non-contiguous input is handled
    x3 = torch.randn(2, rows, 96, generator=generator)
    torch.testing.assert_close(packed(x3), linear(x3), atol=2e-5, rtol=1e-5)
    wide = torch.randn(rows, 192, generator=generator)[:, ::2]
    torch.testing.assert_close(packed(wide), linear(wide), atol=2e-5, rtol=1e-5)


@needs_onednn
def test_packed_weight_unpacks_to_the_dense_weight():
    linear = nn.Linear(64, 48).requires_grad_(False)
    torch.testing.assert_close(PackedLinear.from_linear(linear).weight, linear.weight, atol=0, rtol=0)


@needs_onednn_bf16
def test_bfloat16_packed_linear_agrees_within_bf16_rounding():
    linear = nn.Linear(128, 256, bias=False).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    packed = PackedLinear.from_linear(linear)
    torch.testing.assert_close(packed(x).float(), linear(x).float(), atol=0.05, rtol=0.02)


@needs_onednn
def test_a_model_with_packed_and_fused_projections_gives_the_same_logits():
    model = tiny_llama(layers=2)
    ids = torch.tensor([[3, 9, 27, 1, 5, 60, 2, 8]])
    with torch.inference_mode():
        before = model(ids).logits  # [1, 8, V]
        assert apply_linear_kernel(model, "auto") is LinearKernel.ONEDNN
        after = model(ids).logits
    torch.testing.assert_close(after, before, atol=1e-4, rtol=0)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert all(isinstance(m, FusedPart) for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj))
    assert isinstance(attn.o_proj, PackedLinear) and isinstance(model.lm_head, PackedLinear)
    assert model_linear_kernel(model) is LinearKernel.ONEDNN
    # every part unpacks to its own slice of the fused weight
    reference = tiny_llama(layers=2)
    torch.testing.assert_close(attn.k_proj.weight, reference.model.layers[0].self_attn.k_proj.weight)


@needs_onednn
def test_a_fused_part_called_on_another_input_computes_its_own_slice():
    model = tiny_llama(layers=1)
    attn = model.model.layers[0].self_attn
    reference = tiny_llama(layers=1).model.layers[0].self_attn
    apply_linear_kernel(model, "onednn")
    x, y = torch.randn(3, 32), torch.randn(3, 32)
    with torch.inference_mode():
        attn.q_proj(x)  # computes and keeps k and v of x
        torch.testing.assert_close(attn.k_proj(y), reference.k_proj(y), atol=1e-5, rtol=0)
        torch.testing.assert_close(attn.v_proj(y), reference.v_proj(y), atol=1e-5, rtol=0)


def test_trainable_linears_are_left_alone():
    model = tiny_llama(layers=1).requires_grad_(True)
    apply_linear_kernel(model, "auto")
    assert model_linear_kernel(model) is LinearKernel.NATIVE
    assert type(model.lm_head) is nn.Linear


def test_cuda_and_other_devices_keep_the_native_kernel():
    # The CUDA branch is decided without a GPU: cuBLAS (native) for every dtype, also when asked for auto.
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert resolve_kernel("auto", "cuda", dtype) is LinearKernel.NATIVE
        assert resolve_kernel("auto", "meta", dtype) is LinearKernel.NATIVE
    assert resolve_kernel("native", "cpu", torch.float32) is LinearKernel.NATIVE
    with pytest.raises(FailedPrecondition, match="onednn"):
        resolve_kernel("onednn", "cuda", torch.float32)
    with pytest.raises(ValueError):
        resolve_kernel("mkl", "cpu", torch.float32)


def test_float16_on_cpu_keeps_the_native_kernel():
    assert resolve_kernel("auto", "cpu", torch.float16) is LinearKernel.NATIVE


def test_without_onednn_auto_falls_back_and_onednn_is_refused(monkeypatch):
    # A torch build without oneDNN (some ARM wheels): what `torch.backends.mkldnn` reports there.
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert resolve_kernel("auto", "cpu", torch.float32) is LinearKernel.NATIVE
    with pytest.raises(FailedPrecondition):
        resolve_kernel("onednn", "cpu", torch.float32)
    model = tiny_llama(layers=1)
    assert apply_linear_kernel(model, "auto") is LinearKernel.NATIVE
    assert type(model.lm_head) is nn.Linear


@needs_onednn
def test_on_cpu_auto_picks_onednn_for_float32():
    assert resolve_kernel("auto", "cpu", torch.float32) is LinearKernel.ONEDNN


@needs_onednn_bf16
def test_on_a_cpu_with_a_bf16_path_auto_picks_onednn_for_bfloat16():
    assert resolve_kernel("auto", "cpu", torch.bfloat16) is LinearKernel.ONEDNN


@needs_onednn
def test_on_a_cpu_without_a_bf16_path_bfloat16_keeps_the_native_kernel(monkeypatch):
    # What torch reports on an AVX2-only CPU (AMD Zen 3), where reordering a bf16 weight raises.
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert resolve_kernel("auto", "cpu", torch.bfloat16) is LinearKernel.NATIVE
    assert resolve_kernel("auto", "cpu", torch.float32) is LinearKernel.ONEDNN
    with pytest.raises(FailedPrecondition, match="bfloat16"):
        resolve_kernel("onednn", "cpu", torch.bfloat16)
    model = tiny_llama(layers=1).to(torch.bfloat16)
    assert apply_linear_kernel(model, "auto") is LinearKernel.NATIVE
    assert type(model.lm_head) is nn.Linear
    with torch.inference_mode():
        model(torch.tensor([[3, 9, 27]]))  # runs on torch's kernel
