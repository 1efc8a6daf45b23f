"""Drafts on rounded weights (runtime/quantized_drafts.py): the roundings, the drafts they serve, when.

Each rounding is checked against its definition; a tiny GliDe and a tiny hidden-state draft on int8 score
tokens within the rounding's error of their float selves and pick the same top tokens nearly always; a
separate draft model on 4 bits runs every layer, its embedding and head on codes and still leaves the
output the target's own; a runtime rounds its drafts only when `draft_weights` (or, on `auto`, the
profile beside its file's weights) says so, and the recorded costs are named apart (a draft step on
rounded weights is another cost).
"""

from __future__ import annotations

import pytest
import torch
from tiny_llama import tiny_model
from torch import nn

from specserve.core.request import GenerationRequest
from specserve.eagle.model import build_eagle
from specserve.engine import Engine
from specserve.errors import InvalidArgument
from specserve.glide import build_glide
from specserve.models.tiny import Architecture
from specserve.runtime import quantized_drafts
from specserve.runtime.cpu_kernels import library
from specserve.runtime.draft_runtime import DraftRuntime
from specserve.runtime.int4 import Int4Embedding, Int4Linear
from specserve.runtime.kernels import FusedPart
from specserve.runtime.kv_cache import PositionalKVCache
from specserve.runtime.quantized_drafts import apply_rounded, quantize_int4, quantize_int8
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


def test_each_group_is_rounded_to_4_bit_steps_from_its_least_to_its_largest_weight() -> None:
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    weight[5, :32] = 0.25  # a constant group: step 0, its value kept
    quantized = quantize_int4(weight)
    assert quantized.source == "Q4_1" and quantized.codes.shape == (1, 48, 96)  # one part of 4-bit codes
    codes = torch.from_numpy(quantized.codes[0].astype("int64")).reshape(48, 3, 32)
    grouped = weight.reshape(48, 3, 32)
    least, largest = grouped.amin(-1), grouped.amax(-1)
    step = (largest - least) / 15
    values = torch.from_numpy(quantized.dequantize()).reshape(48, 3, 32)
    # half a step, and the file format's fp16 rounding of the least weight and the step (times 15 at most)
    slack = least.abs() * 2**-11 + 15 * step * 2**-11 + 1e-6
    assert ((values - grouped).abs() <= (step / 2 + slack)[..., None]).all()
    varied = step > 0
    assert int(varied.sum()) == 48 * 3 - 1
    assert (codes.amin(-1)[varied] == 0).all() and (codes.amax(-1)[varied] == 15).all()  # the whole range
    assert (values[5, 0] == 0.25).all() and (codes[5, 0] == 0).all()


def test_only_whole_groups_of_frozen_linear_layers_are_rounded() -> None:
    model = nn.Sequential(nn.Linear(64, 16), nn.Linear(16, 8), nn.Linear(64, 8))
    model.requires_grad_(False)
    model[2].weight.requires_grad_(True)  # trainable: left alone
    assert apply_rounded(model, "int8") == 1
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
    apply_rounded(drafts[1], "int8")
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
    assert EngineSettings(cache_dir=tmp_path, weights="as-shipped").resolved_draft_weights == "dense"
    dense = EngineSettings(cache_dir=tmp_path, weights="dense")
    rounded = EngineSettings(cache_dir=tmp_path, weights="dense", draft_weights="int8")
    # a draft step on int8 weights is another cost: recorded under another name
    assert weights_label(rounded) == weights_label(dense) + "-int8drafts"
    with pytest.raises(InvalidArgument, match="draft_weights"):
        EngineSettings(cache_dir=tmp_path, draft_weights="int3").validate()


@needs_kernel
def test_a_runtime_serves_its_drafts_on_int8_when_set(tiny_target_dir, tmp_path) -> None:
    settings = EngineSettings(model_dir=tiny_target_dir, cache_dir=tmp_path, draft_weights="int8")
    draft = DraftRuntime(settings).glide_draft  # randomly initialised: no trained draft for this target
    assert not any(type(m) is nn.Linear for m in draft.modules())
    assert any(isinstance(m, Int4Linear) for m in draft.modules())


def test_auto_rounds_to_4_bits_only_the_profile_draft_that_chose_it_beside_its_file_weights(tmp_path) -> None:
    qwen = dict(cache_dir=tmp_path, model="qwen2.5-coder-1.5b-instruct")
    chosen = EngineSettings(**qwen, weights="as-shipped")
    assert chosen.resolved_draft_weights == "int4"
    assert (
        weights_label(chosen)
        == weights_label(EngineSettings(**qwen, weights="as-shipped", draft_weights="dense")) + "-int4drafts"
    )
    assert (
        EngineSettings(**qwen, weights="dense").resolved_draft_weights == "dense"
    )  # measured beside the file
    assert EngineSettings(**qwen, weights="as-shipped", draft_dir=tmp_path).resolved_draft_weights == "dense"
    assert EngineSettings(**qwen, weights="as-shipped", draft_weights="int8").resolved_draft_weights == "int8"


@needs_kernel
def test_a_separate_draft_on_4_bits_runs_on_codes_kept_once_and_leaves_the_output_the_targets(
    tiny_target_dir, tiny_draft_dir, tmp_path, monkeypatch
) -> None:
    settings = dict(
        model_dir=tiny_target_dir,
        draft_dir=tiny_draft_dir,
        cache_dir=tmp_path,
        calibration_path=tmp_path / "c.json",
    )
    rounded = Engine(EngineSettings.from_env(**settings, draft_weights="int4"))
    dense = Engine(EngineSettings.from_env(**settings, draft_weights="dense"))
    draft = rounded.vanilla_draft_runner.model
    assert not any(type(m) in (nn.Linear, nn.Embedding) for m in draft.modules())
    assert isinstance(draft.model.embed_tokens, Int4Embedding)  # its own embedding, and its head, on codes
    ids = torch.arange(1000, 1016)[None]
    scores = [engine.vanilla_draft_runner.model(ids).logits[0] for engine in (dense, rounded)]  # [16, V]
    assert not torch.equal(scores[0], scores[1])  # rounded
    # and close: a random tiny model's scores are flat, so their direction, not their top token, is compared
    similarity = torch.nn.functional.cosine_similarity(scores[0], scores[1], dim=-1)
    assert similarity.min() > 0.85, similarity

    # rounded once: the next process reads the rounding kept in the cache
    (store,) = (tmp_path / "models").glob("*.int4")
    monkeypatch.setattr(
        quantized_drafts, "rounded_weights", lambda *args, **kwargs: pytest.fail("rounded again")
    )
    again = Engine(EngineSettings.from_env(**settings, draft_weights="int4")).vanilla_draft_runner.model
    assert torch.equal(again(ids).logits[0], scores[1])
    assert [p.name for p in (tmp_path / "models").iterdir() if not p.name.startswith(".")] == [store.name]

    prompt = list(range(1000, 1016))
    target = GenerationRequest.build(method="target", max_new_tokens=32, ignore_eos=True)
    expected = dense.generate_ids(prompt, target).token_ids
    drafted = rounded.generate_ids(
        prompt, GenerationRequest.build(method="vanilla", max_new_tokens=32, ignore_eos=True)
    )
    assert drafted.token_ids == expected and drafted.stats.num_draft_tokens > 0
