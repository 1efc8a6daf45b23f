"""Linear layers and embeddings on a GGUF file's own 4-bit codes (`models/gguf_quant.py`): weights as shipped.

A step of a small model streams its weights once per token: in float32 that is 5-8x the bytes of the file
the model shipped in. Here each weight stays in its file's codes, packed once at load for one of two
kernels, both computing the file's `(code - 8) * scale + zero` per group of inputs in a float32
accumulator:

- int8-dot (runtime/cpu_kernels.py, CPU): the rows rounded to int8 per group, integer dot products (VNNI
  where the CPU has it), one pass over the weights for all rows of a call: the default on a CPU. The
  formats of more than 4 bits (Q8_0, Q5_0, Q6_K) run there on their own integers, one byte a weight.
- torch's int4 kernel (`_weight_int4pack_mm_for_cpu` on CPU, `_weight_int4pack_mm` on CUDA): the rows,
  scales and zeros in `compute_dtype` (bfloat16 or float16); on CPU it decodes the weights again for
  every 4 rows.

On torch's kernel, formats of more than 4 bits are two 4-bit parts over a widened input (`widen_input`),
so one kernel call per product still covers them. The output is cast back to the model's dtype, so the
residual stream, norms and attention stay as they were. On either kernel a row of an M-row product is
bit-identical to the same row computed alone (the accumulation order per row does not depend on M), so a
tree forward and a one-token forward agree exactly and speculative output equals the target alone's
(tests/specserve/runtime/test_int4.py, test_cpu_kernels.py).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specserve.errors import FailedPrecondition, InvalidArgument
from specserve.models.gguf_quant import GROUP, BlockScales, QuantizedWeight
from specserve.runtime import cpu_kernels
from specserve.runtime.kernels import FUSED_GROUPS, FusedPart, SplitProduct
from specserve.settings import INT4_KERNELS

COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# The kernels a 4-bit weight runs on (settings.INT4_KERNELS): "int8-dot" = runtime/cpu_kernels.py (CPU:
# rows in int8, one pass over the weights for all rows), "torch" = torch's int4 kernel (bfloat16 rows;
# CPU and CUDA); "auto" = int8-dot on a CPU where it builds, torch's elsewhere.


def resolve_int4_kernel(kernel: str, device: torch.device | str) -> str:
    """The kernel that runs: `auto` decided for `device`, or the named one, checked to run there."""
    if kernel not in INT4_KERNELS:
        raise InvalidArgument(f"int4_kernel must be one of {', '.join(INT4_KERNELS)}, got {kernel!r}")
    on_cpu = torch.device(device).type == "cpu"
    if kernel == "auto":
        return "int8-dot" if on_cpu and cpu_kernels.library() is not None else "torch"
    if kernel == "int8-dot" and not (on_cpu and cpu_kernels.library() is not None):
        raise FailedPrecondition(f"the int8-dot kernel runs on a CPU with a C++ compiler, not on {device}")
    return kernel


def int4_available(device: torch.device | str) -> bool:
    """Whether torch has an int4 kernel for `device`."""
    kind = torch.device(device).type
    if kind == "cpu":
        return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    return kind == "cuda" and hasattr(torch.ops.aten, "_weight_int4pack_mm")


def widen_input(x: torch.Tensor, parts: int, group: int) -> torch.Tensor:
    """[M, K] -> the kernel's input for a weight of `parts` parts in groups of `group`: each group of 16
    padded with 16 zeros to the kernel's 32, the whole repeated once per part. [M, parts * K * 32 / group]."""
    if group != GROUP:
        x = F.pad(x.reshape(x.shape[0], -1, group), (0, GROUP - group)).reshape(x.shape[0], -1)
    return x if parts == 1 else x.repeat(1, parts)


def _kernel_layout(weight: QuantizedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes [N, W], scales and zeros [N, W // 32] of the widened weight (parts side by side along the
    inputs, groups of 16 padded with code 8 = value `zero`, which meets a zero input)."""
    parts, n, k = weight.codes.shape
    codes, scales, zeros = weight.codes, weight.scales, weight.zeros
    if weight.group != GROUP:
        grouped = codes.reshape(parts, n, k // weight.group, weight.group)
        pad = np.full((*grouped.shape[:-1], GROUP - weight.group), 8, dtype=np.uint8)
        codes = np.concatenate([grouped, pad], axis=-1).reshape(parts, n, -1)
    return (
        np.concatenate(list(codes), axis=-1),
        np.concatenate(list(scales), axis=-1),
        np.concatenate(list(zeros), axis=-1),
    )


class Int4Weight:
    """One weight [N, K] packed for a 4-bit kernel (`kernel`: "torch" or "int8-dot", as
    `resolve_int4_kernel` names them); `matmul` is the product with it. `compute_dtype` is the dtype the
    kernel reads its rows in: float32 for int8-dot (it rounds them itself), else the given one."""

    def __init__(
        self,
        weight: QuantizedWeight,
        device: torch.device | str = "cpu",
        compute_dtype: torch.dtype = torch.bfloat16,
        kernel: str = "torch",
    ) -> None:
        self.source = weight
        self.parts, self.group = int(weight.codes.shape[0]), weight.group
        self.out_features, self.in_features = weight.shape
        self.kernel = kernel
        self.compute_dtype = torch.float32 if kernel == "int8-dot" else compute_dtype
        self.requested_dtype = compute_dtype  # what a copy of this weight (a cut head) asks for
        self.device = torch.device(device)
        # The kernel packs outputs in tiles of 16: a weight with other row counts (a draft head cut to its
        # kept ids) gets rows of value zero, whose outputs are dropped.
        self.padding = -self.out_features % 16
        signed = weight.signed() if kernel == "int8-dot" else None
        self.bits = 4 if signed is None else 8
        block = weight.block
        if signed is not None:  # the file's own integers on the 8-bit kernel: no parts, no widening
            q, scale = signed
            q = np.concatenate([q, np.zeros((self.padding, q.shape[1]), dtype=np.int8)])
            scale = np.concatenate([scale, np.zeros((self.padding, scale.shape[1]), dtype=np.float32)])
            self.dot_layout = cpu_kernels.pack8(
                q, scale, block if block is not None and block.m is None else None
            )
            return
        codes, scales, zeros = _kernel_layout(weight)
        if self.padding:
            codes = np.concatenate([codes, np.full((self.padding, codes.shape[1]), 8, dtype=np.uint8)])
            scales = np.concatenate([scales, np.zeros((self.padding, scales.shape[1]), dtype=np.float32)])
            zeros = np.concatenate([zeros, np.zeros((self.padding, zeros.shape[1]), dtype=np.float32)])
        if kernel == "int8-dot":
            one_part = self.parts == 1 and self.group == GROUP and block is not None and block.m is not None
            self.dot_layout = cpu_kernels.pack(codes, scales, zeros, block if one_part else None)
            return
        self.packed = pack_int4(torch.from_numpy(codes), self.device)
        # [W // 32, N, 2]: the kernel's scale-and-zero layout.
        pairs = np.stack([scales.T, zeros.T], axis=-1)
        self.scales_zeros = torch.from_numpy(np.ascontiguousarray(pairs)).to(self.device, compute_dtype)

    @property
    def nbytes(self) -> int:
        """Bytes a product reads of this weight: its packed codes, scales and zeros (or biases)."""
        if self.kernel == "int8-dot":
            return self.dot_layout.nbytes
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_zeros))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> x @ W.T [..., N], in x's dtype."""
        y = self.product(x.reshape(-1, self.in_features).to(self.compute_dtype))  # [M, N]
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """[M, K] in compute dtype -> [M, N] in compute dtype (the kernel's own output, not cast back:
        the lean forward casts it where it is read, often for free inside the op that reads it)."""
        if self.bits == 8:
            y = cpu_kernels.dot_mm(rows, self.dot_layout)
        elif self.kernel == "int8-dot":
            y = cpu_kernels.dot_mm(widen_input(rows, self.parts, self.group), self.dot_layout)
        else:
            wide = widen_input(rows, self.parts, self.group)
            y = int4_mm(wide, self.packed, self.scales_zeros)
        return y[:, : self.out_features] if self.padding else y  # [M, N + padding] -> [M, N]

    def dense(self) -> torch.Tensor:
        """[N, K] float32: the weight's values as the file defines them (a draft's copy, the tests)."""
        return torch.from_numpy(self.source.dequantize()).to(self.device)


def pack_int4(codes: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[N, W] uint8 codes 0..15 -> the int4 kernel's packed weight on `device`."""
    if device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    # CUDA's layout takes two codes a byte, the even one in the high nibble, in tiles of 16 inputs times
    # 2, 4 or 8 (the most that divides the row).
    width = codes.shape[1]
    tiles = next((t for t in (8, 4, 2) if width % (16 * t) == 0), 0)
    if not tiles:
        raise ValueError(f"a row of {width} inputs is not whole tiles of 32 for the int4 kernel")
    pairs = (codes[:, 0::2] << 4 | codes[:, 1::2]).to(torch.uint8).to(device)
    return torch.ops.aten._convert_weight_to_int4pack(pairs, tiles)


def int4_mm(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """[M, W] in compute dtype @ packed int4 [N, W].T -> [M, N]."""
    if x.device.type == "cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_zeros)
    return torch.ops.aten._weight_int4pack_mm(x, packed, GROUP, scales_zeros)


def _concat(weights: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """Weights over the same inputs stacked along their outputs (one product for q/k/v or gate/up)."""
    return QuantizedWeight(
        codes=np.concatenate([w.codes for w in weights], axis=1),
        scales=np.concatenate([w.scales for w in weights], axis=1),
        zeros=np.concatenate([w.zeros for w in weights], axis=1),
        group=weights[0].group,
        source=weights[0].source,
        block=_concat_blocks([w.block for w in weights]),
    )


def _concat_blocks(blocks: Sequence[BlockScales | None]) -> BlockScales | None:
    """The members' block scales stacked along the outputs, where every member has the same kind."""
    present = [b for b in blocks if b is not None]
    if len(present) != len(blocks) or len({tuple(b.arrays()) for b in present}) != 1:
        return None
    names = present[0].arrays()
    return BlockScales(**{name: np.concatenate([b.arrays()[name] for b in present]) for name in names})


class Int4Linear(nn.Module):
    """A frozen linear layer on its file's 4-bit codes."""

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.int4 = weight
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.in_features, self.out_features = weight.in_features, weight.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.int4.dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.int4.matmul(x)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        source = self.int4.source.source
        return f"in_features={self.in_features}, out_features={self.out_features}, weights={source}"


class Int4Product(SplitProduct):
    """The fused product of projections that read the same input (runtime/kernels.FusedPart's product)."""

    def __init__(
        self,
        weights: Sequence[QuantizedWeight],
        biases: Sequence[torch.Tensor | None],
        device: torch.device,
        dtype: torch.dtype,
        kernel: str = "torch",
    ) -> None:
        super().__init__()
        self.weight = Int4Weight(_concat(weights), device, dtype, kernel)
        self.widths = [w.shape[0] for w in weights]
        self.total = sum(self.widths)
        self.bias = (
            None
            if all(b is None for b in biases)
            else torch.cat(
                [
                    b.detach() if b is not None else torch.zeros(width, device=device)
                    for b, width in zip(biases, self.widths, strict=True)
                ]
            )
        )

    def parts(self, x: torch.Tensor) -> list[torch.Tensor]:
        y = self.weight.matmul(x)
        if self.bias is not None:
            y = y + self.bias
        return list(y.split(self.widths, dim=-1))

    def dense(self) -> torch.Tensor:
        return self.weight.dense()


class Int4Embedding(nn.Module):
    """An embedding table on its file's codes: the looked-up rows are decoded exactly, in float32.

    A signed 8-bit-or-narrower format whose scales are fp16 values (a file's Q8_0 or Q5_0) keeps its own
    integers, one byte a value, and decodes q * scale: every such product is exact in float32, so the
    rows are bit for bit what the two 4-bit parts would give (`QuantizedWeight.dequantize`), in half the
    memory (the default model's 49,152-row table: 31 MB instead of 68). Any other format keeps its parts.
    """

    def __init__(self, weight: QuantizedWeight, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.group = weight.group
        self.num_embeddings, self.embedding_dim = weight.shape
        self.zeros: torch.Tensor | None = None
        signed = _exact_signed(weight)
        if signed is not None:
            q, scale = signed
            self.codes = torch.from_numpy(np.ascontiguousarray(q)).to(device)  # [V, K] int8
            self.scales = torch.from_numpy(np.ascontiguousarray(scale)).to(device)  # [V, G]
            return
        # [V, P, K] codes, [V, P, G] scales and zeros: one gather per lookup.
        self.codes = torch.from_numpy(np.ascontiguousarray(weight.codes.transpose(1, 0, 2))).to(device)
        self.scales = torch.from_numpy(np.ascontiguousarray(weight.scales.transpose(1, 0, 2))).to(device)
        self.zeros = torch.from_numpy(np.ascontiguousarray(weight.zeros.transpose(1, 0, 2))).to(device)

    @functools.cached_property
    def weight(self) -> torch.Tensor:
        """[V, K] the table's values, decoded once on first use (what a float copy of the table needs)."""
        return self(torch.arange(self.num_embeddings, device=self.codes.device))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., K]
        flat = input_ids.reshape(-1)
        n, k = flat.shape[0], self.embedding_dim
        if self.zeros is None:  # the format's own integers
            q = self.codes[flat].float().reshape(n, k // self.group, self.group)  # [n, G, group]
            values = q * self.scales[flat][..., None]
            return values.reshape(*input_ids.shape, k).to(self.dtype)
        codes = self.codes[flat].float()  # [n, P, K]
        parts = codes.shape[1]
        grouped = codes.reshape(n, parts, k // self.group, self.group) - 8.0
        values = grouped * self.scales[flat][..., None] + self.zeros[flat][..., None]  # [n, P, G, group]
        return values.sum(1).reshape(*input_ids.shape, k).to(self.dtype)


def _exact_signed(weight: QuantizedWeight) -> tuple[np.ndarray, np.ndarray] | None:
    """A signed format's integers and scales where q * scale is exact in float32 for every value: scales
    that are fp16 values (11 significant bits) times integers of at most 8 bits fit float32's 24."""
    signed = weight.signed()
    if signed is None or weight.block is not None:
        return None
    q, scale = signed
    if not np.array_equal(scale.astype(np.float16).astype(np.float32), scale):
        return None
    return q, scale


def runs_on_int4(model: nn.Module) -> bool:
    """Whether any linear layer of `model` runs on int4 codes (this module's)."""
    return any(
        isinstance(m, Int4Linear) or (isinstance(m, FusedPart) and isinstance(m.product, Int4Product))
        for m in model.modules()
    )


def apply_as_shipped(
    model: nn.Module,
    weights: Mapping[str, QuantizedWeight],
    compute_dtype: torch.dtype = torch.bfloat16,
    kernel: str = "auto",
) -> int:
    """Replaces every linear layer and embedding of `model` whose weight `weights` holds (by parameter
    name) with its int4 form on `kernel` (INT4_KERNELS); the LM head of a tied model runs on the
    embedding's codes. Returns how many modules were replaced. Projections that read the same input
    become one product (q/k/v, gate/up)."""
    device = next(model.parameters()).device
    kernel = resolve_int4_kernel(kernel, device)
    dtype = next(model.parameters()).dtype
    replaced = 0
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    with torch.no_grad():
        for path, module in list(model.named_modules()):
            prefix = f"{path}." if path else ""
            replaced += _fuse(module, prefix, weights, device, compute_dtype, kernel)
            for name, child in list(module.named_children()):
                key = f"{prefix}{name}.weight"
                if key not in weights:
                    continue
                if isinstance(child, nn.Embedding):
                    setattr(module, name, Int4Embedding(weights[key], device, dtype))
                elif type(child) is nn.Linear:
                    bias = child.bias
                    weight = Int4Weight(weights[key], device, compute_dtype, kernel)
                    setattr(module, name, Int4Linear(weight, bias))
                else:
                    continue
                replaced += 1
        head_key = "model.embed_tokens.weight"
        if tied and "lm_head.weight" not in weights and head_key in weights and hasattr(model, "lm_head"):
            model.lm_head = Int4Linear(Int4Weight(weights[head_key], device, compute_dtype, kernel), None)
            replaced += 1
    return replaced


def _fuse(
    module: nn.Module,
    prefix: str,
    weights: Mapping[str, QuantizedWeight],
    device: torch.device,
    compute_dtype: torch.dtype,
    kernel: str,
) -> int:
    """Turns each complete same-input group of `module` with one layout into parts of one product."""
    fused = 0
    for group in FUSED_GROUPS:
        linears = [getattr(module, name, None) for name in group]
        keys = [f"{prefix}{name}.weight" for name in group]
        if not all(type(linear) is nn.Linear for linear in linears) or not all(k in weights for k in keys):
            continue
        members = [weights[k] for k in keys]
        if len({(w.codes.shape[0], w.group, w.shape[1]) for w in members}) != 1:
            continue  # parts or groups differ (a Q6_K v beside Q4_K q/k): each keeps its own product
        biases = [linear.bias for linear in linears if isinstance(linear, nn.Linear)]
        product = Int4Product(members, biases, device, compute_dtype, kernel)
        for index, name in enumerate(group):
            setattr(module, name, FusedPart(product, index, members[0].shape[1]))
        fused += len(group)
    return fused


@dataclass(frozen=True)
class Int4Step:
    """One int4 product of a layer (runtime/int4.py) and its bias: what the as-shipped layer calls
    directly, without module dispatch, splitting or casting the kernel's output between products."""

    weight: Int4Weight
    bias: torch.Tensor | None  # [N] in the model's dtype

    def to_model(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The kernel's output [M, N] (compute dtype) -> the model's dtype, bias added (as Int4Linear)."""
        y = y.to(dtype)
        return y if self.bias is None else y + self.bias

    def add_to(self, hidden: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """hidden [M, N] + the kernel's output y [M, N] as Int4Linear returns it; without a bias a float32
        stream lets the add promote y (each bf16 value exactly, as the cast did)."""
        if self.bias is None and torch.promote_types(hidden.dtype, y.dtype) == hidden.dtype:
            return hidden + y
        return hidden + self.to_model(y, hidden.dtype)


@dataclass(frozen=True)
class Int4Layer:
    """A decoder layer's four products on int4 codes: q/k/v fused (q, k, v side by side along the
    outputs), o, gate/up fused, down."""

    qkv: Int4Step
    o: Int4Step
    gate_up: Int4Step
    down: Int4Step


def _int4_step(modules: Sequence[nn.Module]) -> Int4Step | None:
    """The one int4 product behind `modules` (one Int4Linear, or every part of one Int4Product in order)."""
    first = modules[0]
    if len(modules) == 1 and isinstance(first, Int4Linear):
        return Int4Step(first.int4, first.bias)
    product = getattr(first, "product", None)
    if not isinstance(product, Int4Product) or len(modules) != len(product.widths):
        return None
    in_order = all(
        isinstance(m, FusedPart) and m.product is product and m.index == i for i, m in enumerate(modules)
    )
    return Int4Step(product.weight, product.bias) if in_order else None


@dataclass(frozen=True)
class Int4Projections:
    """A decoder layer's products for the compiled layers: q/k/v and gate/up each as one fused product,
    or one product per projection where their formats differ (a Q6_K v beside Q4_K q and k)."""

    qkv: tuple[Int4Step, ...]
    o: Int4Step
    gate_up: tuple[Int4Step, ...]
    down: Int4Step


def _int4_steps(modules: Sequence[nn.Module]) -> tuple[Int4Step, ...] | None:
    """The products behind `modules` in order: their one fused product, or one each; None if any is not
    on int4 codes."""
    fused = _int4_step(modules)
    if fused is not None:
        return (fused,)
    alone = [_int4_step([module]) for module in modules]
    return None if any(step is None for step in alone) else tuple(s for s in alone if s is not None)


def int4_projections(layers: Sequence[Any]) -> list[Int4Projections] | None:
    """Every layer's products, fused or apart, when all of them run on int4 codes; else None."""
    out = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = _int4_steps([attn.q_proj, attn.k_proj, attn.v_proj])
        o, gate_up, down = (
            _int4_step([attn.o_proj]),
            _int4_steps([mlp.gate_proj, mlp.up_proj]),
            _int4_step([mlp.down_proj]),
        )
        if qkv is None or o is None or gate_up is None or down is None:
            return None
        out.append(Int4Projections(qkv, o, gate_up, down))
    return out


def int4_layers(layers: Sequence[Any]) -> list[Int4Layer] | None:
    """Every layer's products when all of them run on int4 codes (weights as shipped) with q/k/v and
    gate/up each one fused product (what the torch-op layer reads), else None."""
    projections = int4_projections(layers)
    if projections is None or any(len(p.qkv) != 1 or len(p.gate_up) != 1 for p in projections):
        return None
    return [Int4Layer(p.qkv[0], p.o, p.gate_up[0], p.down) for p in projections]
