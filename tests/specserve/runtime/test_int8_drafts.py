"""Drafts on 8-bit weights (runtime/int8_drafts.py): the rounding, the drafts it serves, when it is used.

The rounding is checked against its definition; a tiny GliDe and a tiny hidden-state draft on int8 score
tokens within the rounding's error of their float selves and pick the same top tokens nearly always; a
runtime rounds its drafts only when `draft_weights` says so (measured slower beside the file's weights),
and the recorded costs are named apart (a draft step on int8 weights is another cost).
"""

from __future__ import annotations

import pytest
import torch
from tiny_llama import tiny_model
from torch import nn

from specserve.eagle.model import build_eagle
from specserve.errors import InvalidArgument
from specserve.glide import build_glide
from specserve.models.tiny import Architecture
from specserve.runtime.cpu_kernels import library
from specserve.runtime.draft_runtime import DraftRuntime
from specserve.runtime.int4 import Int4Linear
from specserve.runtime.int8_drafts import apply_int8, quantize_int8
from specserve.runtime.kernels import FusedPart
from specserve.runtime.kv_cache import PositionalKVCache
from specserve.runtime.target_runtime import weights_label
from specserve.settings import EngineSettings

needs_kernel = pytest.mark.skipif(library() is None, reason="the int8-dot kernel needs the built CPU library")


def test_each_group_is_rounded_to_int8_steps_of_its_own_scale() -> None:
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    weight[3, 32:64] = 0.0  # a group of zeros keeps scale 0
    quantized = quantize_int8(weight)
    q, scale = quantized.signed()  # the kernel's own integers: the format is the file's Q8_0
    assert q.shape == (48, 96) and scale.shape == (48, 3)
    grouped = weight.reshape(48, 3, 32)
    expected_scale = grouped.abs().amax(-1) / 127
    assert torch.allclose(torch.from_numpy(scale), expected_scale)
    values = torch.from_numpy(quantized.dequantize())
    assert (values.reshape(48, 3, 32) - grouped).abs().le(expected_scale[..., None] / 2 + 1e-7).all()
    assert int(torch.from_numpy(q).abs().max()) == 127  # each group's largest weight is +-127 steps
    assert not values[3, 32:64].any()


def test_only_whole_groups_of_frozen_linear_layers_are_rounded() -> None:
    model = nn.Sequential(nn.Linear(64, 16), nn.Linear(16, 8), nn.Linear(64, 8))
    model.requires_grad_(False)
    model[2].weight.requires_grad_(True)  # trainable: left alone
    assert apply_int8(model) == 1
    assert isinstance(model[0], Int4Linear)
    assert type(model[1]) is nn.Linear  # 16 inputs: no whole group of 32
    assert type(model[2]) is nn.Linear


def draft_pair(kind: str) -> tuple[nn.Module, nn.Module]:
    target = tiny_model(Architecture.LLAMA)
    build = build_glide if kind == "glide" else build_eagle
    drafts = []
    for _ in range(2):
        draft = build(target, seed=0)
        draft.init_weights(torch.Generator().manual_seed(0), std=0.3)
        drafts.append(draft.eval().requires_grad_(False))
    apply_int8(drafts[1])
    return target, *drafts


@needs_kernel
def test_a_glide_draft_on_int8_scores_within_the_rounding_and_fuses_its_projections() -> None:
    target, dense, rounded = draft_pair("glide")
    assert any(isinstance(m, FusedPart) for m in rounded.modules())  # q/k/v, gate/up: one product each
    assert not any(type(m) is nn.Linear for m in rounded.modules())
    cfg = target.config
    generator = torch.Generator().manual_seed(1)
    kv_heads, head_dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    target_kv = (torch.randn(1, kv_heads, 12, head_dim, generator=generator),) * 2
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=generator)
    scores = []
    for draft in (dense, rounded):
        cache = PositionalKVCache(dense.config.num_layers, 16)
        hidden = draft(ids, target_kv, None, torch.arange(12), cache)
        scores.append(draft.logits(hidden[0]))  # [12, V]
    error = (scores[0] - scores[1]).abs().max() / scores[0].abs().max()
    assert 0 < error < 0.05, error  # rounded, and close
    assert (scores[0].argmax(-1) == scores[1].argmax(-1)).float().mean() >= 0.9


@needs_kernel
def test_a_hidden_state_draft_on_int8_scores_within_the_rounding() -> None:
    target, dense, rounded = draft_pair("eagle")
    generator = torch.Generator().manual_seed(2)
    features = torch.randn(1, 10, target.config.hidden_size, generator=generator)
    ids = torch.randint(0, target.config.vocab_size, (1, 10), generator=generator)
    scores = [draft.logits(draft(draft.lift(features), ids)[0]) for draft in (dense, rounded)]
    error = (scores[0] - scores[1]).abs().max() / scores[0].abs().max()
    assert 0 < error < 0.05, error
    assert (scores[0].argmax(-1) == scores[1].argmax(-1)).float().mean() >= 0.9


def test_drafts_are_dense_unless_set_and_their_costs_are_named_apart(tmp_path) -> None:
    assert EngineSettings(cache_dir=tmp_path).draft_weights == "dense"
    dense = EngineSettings(cache_dir=tmp_path, weights="dense")
    rounded = EngineSettings(cache_dir=tmp_path, weights="dense", draft_weights="int8")
    # a draft step on int8 weights is another cost: recorded under another name
    assert weights_label(rounded) == weights_label(dense) + "-int8drafts"
    with pytest.raises(InvalidArgument, match="draft_weights"):
        EngineSettings(cache_dir=tmp_path, draft_weights="auto").validate()


@needs_kernel
def test_a_runtime_serves_its_drafts_on_int8_when_set(tiny_target_dir, tmp_path) -> None:
    settings = EngineSettings(model_dir=tiny_target_dir, cache_dir=tmp_path, draft_weights="int8")
    draft = DraftRuntime(settings).glide_draft  # randomly initialised: no trained draft for this target
    assert not any(type(m) is nn.Linear for m in draft.modules())
    assert any(isinstance(m, Int4Linear) for m in draft.modules())
