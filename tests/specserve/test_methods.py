"""Every registered method through the engine on tiny random models: greedy output equals the target's,
every lossless method samples the target's distribution, and a lossy method needs an explicit opt-in.
On the Qwen2 tiny model (q/k/v biases, head_dim != hidden / heads, RoPE theta 1e6, tied head) the target
equals transformers' generate and one method of each drafter family equals the target."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare
from seeded_runs import seeded_runs
from tiny_llama import EACH_ARCHITECTURE

from specserve.catalog import method_info
from specserve.core.cost import GLIDE_DRAFT, DraftCost, draft_costs_from_json, verify_points_from_json
from specserve.core.finish import FinishChecker
from specserve.core.loop import speculative_generate
from specserve.core.request import GenerationRequest, StoppingParams
from specserve.core.sampling import logits_to_probs
from specserve.core.sampling_params import SamplingParams
from specserve.engine import Engine
from specserve.errors import InvalidArgument
from specserve.methods import METHODS, Method
from specserve.models.tiny import Architecture
from specserve.runtime import cpu_kernels
from specserve.runtime.calibrate import BATCH_TOTALS, load_record
from specserve.runtime.target import LocalVerifier
from specserve.settings import EngineSettings

DRAFTING = [m for m, spec in METHODS.items() if not spec.uses_hf_generate and m is not Method.TARGET]
LOSSLESS = [m for m in DRAFTING if METHODS[m].lossless]


def _one_per_family_and_stop_policy(methods: list[Method]) -> list[Method]:
    """The distribution test samples each drafter family (draft, tree, suffix) and each stop policy once
    (CI time). A method differing from a sampled one only in its depth or stop policy drafts trees of
    another size from the same draws, and the verifier's rule is the same one."""
    families: set[tuple] = set()
    policies: set[str] = set()
    kept = []
    for method in methods:
        axes = method_info(method.value).axes
        assert axes is not None
        family = (axes.draft, axes.tree, axes.suffix)
        if family not in families or axes.stop.value not in policies:
            kept.append(method)
        families.add(family)
        policies.add(axes.stop.value)
    return kept


# vanilla-cape-suffix draws its candidates as vanilla-cape-cost and glide-cape-suffix do.
SAMPLED = _one_per_family_and_stop_policy([m for m in LOSSLESS if m is not Method.VANILLA_CAPE_SUFFIX])
PROMPT = [3, 17, 5, 9, 41, 2, 33, 8]
# On Qwen2, one method per drafter family: GliDe (CaPE trees over the target's K/V), the early-exit
# draft, the suffix index and the hidden-state draft; the others share these code paths.
QWEN2_METHODS = (Method.GLIDE_CAPE, Method.VANILLA, Method.SUFFIX, Method.EAGLE)
GREEDY_CASES = [(Architecture.LLAMA, m) for m in DRAFTING] + [(Architecture.QWEN2, m) for m in QWEN2_METHODS]


def tiny_engine(model_dir, calibration_path, linear_kernel: str | None = None) -> Engine:
    settings = EngineSettings.from_env(
        model_dir=model_dir, draft_layers=1, calibration_path=calibration_path, linear_kernel=linear_kernel
    )
    return Engine(settings)


@pytest.fixture(scope="module")
def calibration_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("calibration")


@pytest.fixture(scope="module")
def engine(architecture, architecture_target_dir, calibration_dir) -> Engine:
    # One calibration per architecture, however many engines of it the parametrisation makes.
    return tiny_engine(architecture_target_dir, calibration_dir / f"{architecture}.json")


def greedy(method: Method) -> GenerationRequest:
    return GenerationRequest.build(method=method, max_new_tokens=24, ignore_eos=True)


@pytest.mark.parametrize(("architecture", "method"), GREEDY_CASES, ids=str, scope="module")
def test_greedy_output_equals_the_target(engine, method):
    expected = engine.generate_ids(PROMPT, greedy(Method.TARGET)).token_ids
    assert engine.generate_ids(PROMPT, greedy(method)).token_ids == expected


@EACH_ARCHITECTURE
def test_the_target_equals_transformers_generate(engine):
    """What the methods above equal is transformers' own greedy decoding (a plain model, torch's kernel)."""
    expected = engine.generate_ids(PROMPT, greedy(Method.HF)).token_ids
    assert engine.generate_ids(PROMPT, greedy(Method.TARGET)).token_ids == expected
    assert len(set(expected)) > 3  # a real continuation, not one token repeated


def test_transformers_assisted_generation_and_the_separate_draft_methods_equal_the_target(
    tiny_target_dir, tiny_draft_dir, tmp_path
):
    """hf-assisted (transformers' assistant_model) and the vanilla methods draft with the separate draft
    model when there is one; every one of them gives the target's tokens."""
    settings = EngineSettings.from_env(
        model_dir=tiny_target_dir, draft_dir=tiny_draft_dir, calibration_path=tmp_path / "costs.json"
    )
    engine = Engine(settings)
    expected = engine.generate_ids(PROMPT, greedy(Method.TARGET)).token_ids
    methods = (
        Method.HF_ASSISTED,
        Method.VANILLA,
        Method.VANILLA_CAPE_COST,
        Method.VANILLA_CAPE_SUFFIX,
        Method.VANILLA_GATED,
    )
    for method in methods:
        assert engine.generate_ids(PROMPT, greedy(method)).token_ids == expected, method
    assert engine.assistant_model.config.num_hidden_layers == 1  # the tiny draft, not the target's layers
    assert dict((kind, step) for kind, step, _ in engine.cost_model.other_drafts)["vanilla"] > 0


def test_the_cost_method_measured_this_machine_once(engine):
    cost = engine.cost_model  # measured by an earlier test's cost method, or now when run alone
    # The target's curve and the drafts' steps are recorded apart: a draft replica records its own only.
    assert verify_points_from_json(load_record(engine.calibration_path)) == cost.verify_points
    drafts = draft_costs_from_json(load_record(engine.drafts.draft_costs_path))
    assert drafts[GLIDE_DRAFT] == DraftCost(cost.draft_step_s, cost.draft_overhead_s)
    assert {kind: (c.step_s, c.overhead_s) for kind, c in drafts.items() if kind != GLIDE_DRAFT} == {
        kind: (step, overhead) for kind, step, overhead in cost.other_drafts
    }
    assert cost.verify_points[0][0] == 1 and cost.draft_step_s >= 0
    assert cost.verify_points[-1][0] == BATCH_TOTALS[-1]  # batched forwards are calibrated too


def test_the_default_calibration_file_is_kept_per_device_and_dtype(tiny_target_dir, tmp_path, monkeypatch):
    # a CPU whose oneDNN has a bf16 path (AVX-512); resolving the kernel loads no model
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)

    def default_path(**overrides) -> str:
        settings = EngineSettings.from_env(
            environ={}, model_dir=tiny_target_dir, cache_dir=tmp_path, **overrides
        )
        return Engine(settings).calibration_path.name

    fp32, bf16, cuda = default_path(), default_path(dtype="bfloat16"), default_path(device="cuda:0")
    native = default_path(linear_kernel="native")
    assert len({fp32, bf16, cuda, native}) == 4
    # weights as shipped have costs of their own, per 4-bit kernel
    assert default_path(weights="as-shipped", int4_kernel="torch").endswith("-cpu-float32-int4-settled.json")
    if cpu_kernels.library() is not None:  # per build of the CPU's kernels
        build = cpu_kernels.build_key()
        assert build is not None
        assert default_path(weights="as-shipped").endswith(f"-cpu-float32-int8dot-{build[:8]}-settled.json")
        monkeypatch.setattr(cpu_kernels, "build_key", lambda: "0123456789abcdef")  # the kernels changed
        assert default_path(weights="as-shipped").endswith("-cpu-float32-int8dot-01234567-settled.json")
    assert bf16.endswith("-cpu-bfloat16-onednn-settled.json") and cuda.endswith(
        "-cuda0-float32-native-settled.json"
    )
    assert fp32.endswith("-cpu-float32-onednn-settled.json") and native.endswith(
        "-cpu-float32-native-settled.json"
    )
    # an AVX2-only CPU runs bf16 on torch's own kernel, and its costs are kept apart from the packed ones
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert default_path(dtype="bfloat16").endswith("-cpu-bfloat16-native-settled.json")


def test_the_calibration_records_the_kernel_and_forward_it_measured(engine):
    assert engine.cost_model is not None  # measured once per module (or by an earlier test)
    record = json.loads(engine.calibration_path.read_text())
    assert record["linear_kernel"] == engine.linear_kernel.value == "onednn"
    assert record["forward"] == "lean"  # the tiny Llama runs the lean forward
    expected = {"linear_kernel": "onednn", "weights": "dense", "int4_kernel": "-", "forward": "lean"}
    assert engine.runtime_info() == expected
    assert record["weights"] == "dense"


def test_only_float32_is_promised_token_for_token(tiny_target_dir, tmp_path, caplog):
    def engine_with(dtype: str) -> Engine:
        settings = EngineSettings.from_env(
            environ={}, model_dir=tiny_target_dir, cache_dir=tmp_path, dtype=dtype
        )
        return Engine(settings)

    with caplog.at_level(logging.WARNING, logger="specserve.engine"):
        engine_with("float32")
        assert "up to rounding" not in caplog.text
        engine_with("bfloat16")
        assert "dtype bfloat16" in caplog.text and "up to rounding" in caplog.text


def test_a_lossy_method_is_refused_at_t_above_0_without_the_opt_in(engine):
    assert not METHODS[Method.MCSD_TARGET_INIT].lossless
    sampled = GenerationRequest(
        Method.MCSD_TARGET_INIT, SamplingParams(temperature=0.8), StoppingParams(8, ignore_eos=True), seed=1
    )
    with pytest.raises(InvalidArgument, match="allow_lossy"):
        engine.generate_ids(PROMPT, sampled)
    allowed = replace(sampled, allow_lossy=True)
    assert len(engine.generate_ids(PROMPT, allowed).token_ids) == 8


# --- sampling: a 16-token vocabulary, so the target's distribution is checked whole --------------

V = 16
SMALL_PROMPT = [1, 2, 3, 0, 1]


@pytest.fixture(scope="module")
def small_engine(tiny_vocab_target_dir, pinned_costs) -> Engine:
    # torch's own F.linear: on these 64-wide layers a packed oneDNN call costs 30-70 us against 3-6, a
    # third of each sampling test's 1,500 trials, and the rule under test does not depend on the kernel
    # (the greedy tests above run the packed weights). The pinned costs (a draft step a tenth of the
    # target's): measured, a tiny model's draft costs about what its target does, and the cost and gated
    # policies would send the root alone, proving nothing about their trees.
    return tiny_engine(tiny_vocab_target_dir, pinned_costs, linear_kernel="native")


def first_round(engine: Engine, method: Method, params: SamplingParams, seed: int) -> tuple[int, int]:
    """The token the first speculative round decides, and the tokens it drafted: the method's own
    drafter (its registry factory) in the engine's loop; the 16-token model has no tokenizer for
    Engine.generate to decode with, so the loop is driven directly."""
    capacity = len(SMALL_PROMPT) + 2 + engine.settings.max_tree_nodes + 1
    verifier = LocalVerifier(engine.target_runner, capacity, sampling=params)
    drafter = METHODS[method].make_drafter(engine, capacity, verifier.cache, params)
    finish = FinishChecker(2, frozenset())
    stats = speculative_generate(SMALL_PROMPT, verifier, drafter, seed, finish)
    return finish.generated[1], stats.num_draft_tokens


@pytest.mark.compute_only
@pytest.mark.parametrize("method", SAMPLED)
def test_sampling_keeps_the_target_distribution(small_engine, method):
    """Token 2 is the first one a speculative round decides (token 1 comes from the prefill)."""
    params = SamplingParams(temperature=1.0)
    model = small_engine.target_model

    def probs(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return logits_to_probs(model(torch.tensor([ids])).logits[0, -1], params)

    p1 = probs(SMALL_PROMPT)
    p2 = sum(p1[x1] * probs([*SMALL_PROMPT, x1]) for x1 in range(V))  # [V]
    trials = 1500
    counts = torch.zeros(V)
    drafting = 0  # runs whose round drafted: a round of the root alone would prove nothing
    for token, drafted in seeded_runs(lambda seed: first_round(small_engine, method, params, seed), trials):
        counts[token] += 1
        drafting += drafted > 0
    # Every run drafts, but the suffix index's alone: it finds a match after some first tokens only
    # (about one run in twenty).
    assert drafting == trials or (method is Method.SUFFIX and drafting > trials // 50)
    expected = p2 * trials
    frequent = expected >= 5  # chi-square needs expected counts of ~5; the rare rest is pooled
    observed = torch.cat([counts[frequent], counts[~frequent].sum()[None]])
    expected = torch.cat([expected[frequent], expected[~frequent].sum()[None]])
    if expected[-1] < 5:
        observed, expected = observed[:-1], expected[:-1]
        observed[-1] += trials - observed.sum()
        expected[-1] += trials - expected.sum()
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3
