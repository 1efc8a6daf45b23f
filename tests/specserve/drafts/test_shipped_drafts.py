"""The drafts shipped for the default model: they load, they are trained, and output stays lossless.

Greedy: every shipped-draft method reproduces the target's own greedy tokens. Sampling: a real CaPE tree
from the shipped GliDe draft, verified against the real target's logits under many seeds, emits its
first token with exactly the target's distribution (chi-square).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare
from shipped_methods import SHIPPED_DRAFT_METHODS

from specserve.catalog import CATALOG, DEFAULT_METHOD, Method
from specserve.core.accept import accept_draft
from specserve.core.cape import CapeSettings
from specserve.core.request import GenerationRequest
from specserve.core.sampling import logits_to_probs
from specserve.core.sampling_params import GREEDY, SamplingParams
from specserve.core.stopping import CostPolicy
from specserve.core.tree import tree_children
from specserve.drafts import STOPPER_DIR, DraftKind, shipped_draft_dir, stopper_dir
from specserve.engine import Engine
from specserve.glide.drafter import GlideDrafter
from specserve.methods import method_spec
from specserve.runtime.drafter import DraftShape
from specserve.runtime.stopper import load_decision_model, shipped_decision_model
from specserve.runtime.target import LocalVerifier

pytestmark = [pytest.mark.model, pytest.mark.compute_only]

PROMPTS = [
    "Give me three tips for staying focused while studying.",
    "Write a Python function that returns the largest of three numbers.",
    "Explain why the sky is blue in two sentences.",
]


def greedy_40(method: str) -> GenerationRequest:
    return GenerationRequest.build(method=method, max_new_tokens=40)


@pytest.fixture(scope="module")
def engine(default_engine: Engine) -> Engine:
    return default_engine


def test_every_draft_ships_with_its_training_record() -> None:
    for kind in DraftKind:
        directory = shipped_draft_dir(kind)
        assert directory is not None, kind
        record = json.loads((directory / "training.json").read_text())
        if kind is DraftKind.EAGLE:
            assert record["settings"]["kind"] == "eagle"
        else:
            assert record["settings"]["cross_attention"] is (kind is DraftKind.GLIDE)
        assert (directory / "model.safetensors").stat().st_size < 25_000_000  # small enough for the repo


@pytest.mark.parametrize("kind", [DraftKind.GLIDE, DraftKind.EAGLE])
def test_a_stopper_ships_trained_on_each_drafts_own_runs(kind: DraftKind) -> None:
    directory = stopper_dir(kind)
    record = json.loads((directory / "stopper.json").read_text())
    assert record["held_out_auc"] > 0.7 and record["num_held_out"] >= 1000
    assert record["prompts"] == "specserve.training.prompts.written_prompts"  # never benchmark prompts
    assert record["drafter"].startswith(f"{kind.value} (shipped draft)")
    model = load_decision_model(directory)
    sure = torch.tensor([20.0] + [0.0] * 99)  # nearly all mass on one token
    unsure = torch.zeros(100)  # uniform
    assert model.acceptance(sure) > 0.6 > 0.3 > model.acceptance(unsure)


def test_each_drafts_cost_policy_reads_the_stopper_trained_on_that_draft(engine) -> None:
    """The default method's policy predicts acceptance with the hidden-state draft's stopper, GliDe's
    methods with GliDe's; a draft with no stopper of its own falls back to GliDe's."""
    assert stopper_dir(DraftKind.GLIDE) == STOPPER_DIR
    assert CATALOG[Method(DEFAULT_METHOD)].model_method == Method.EAGLE_CAPE_COST
    for method, kind in (("eagle-cape-cost", DraftKind.EAGLE), ("glide-cape-cost", DraftKind.GLIDE)):
        verifier = LocalVerifier(engine.target_runner, 64)
        drafter = method_spec(method).make_drafter(engine, 64, verifier.cache, GREEDY)
        try:
            policy = getattr(drafter, "stop_policy", None)
            assert isinstance(policy, CostPolicy), method
            assert policy.model is load_decision_model(stopper_dir(kind)), method
        finally:
            verifier.release()
            drafter.release()
    assert shipped_decision_model("vanilla") is load_decision_model(STOPPER_DIR)
    assert load_decision_model(stopper_dir(DraftKind.EAGLE)) is not load_decision_model(STOPPER_DIR)


def test_engine_uses_the_shipped_drafts_for_the_default_model(engine) -> None:
    assert engine.glide_draft.config.cross_attention
    assert engine.glide_draft.config.draft_vocab_size == 8192
    vanilla = engine.vanilla_glide_draft
    assert vanilla is not None and not vanilla.config.cross_attention


@pytest.fixture(scope="module")
def target_tokens(engine) -> dict[str, list[int]]:
    """The target's own greedy tokens per prompt, generated once for every method below."""
    return {p: engine.generate(p, greedy_40("target")).token_ids for p in PROMPTS}


@pytest.mark.parametrize("method", SHIPPED_DRAFT_METHODS)
def test_greedy_output_equals_the_target_and_drafts_are_accepted(engine, target_tokens, method) -> None:
    accepted = 0
    for prompt in PROMPTS:
        result = engine.generate(prompt, greedy_40(method))
        assert result.token_ids == target_tokens[prompt], prompt
        accepted += result.stats.num_accepted_tokens
    # Trained: >= 10 of the 120 tokens came from the draft (the untrained early-exit draft gave ~2).
    assert accepted >= 10


def test_sampled_verification_of_a_shipped_cape_tree_keeps_the_target_distribution(engine) -> None:
    params = SamplingParams(temperature=0.7)
    prompt_ids = engine.encode_prompt(PROMPTS[0])
    verifier = LocalVerifier(engine.target_runner, capacity=len(prompt_ids) + 64)
    root = verifier.prefill(prompt_ids, 0)
    capacity = len(prompt_ids) + 64
    cape = CapeSettings()
    drafter = GlideDrafter(engine.glide_draft, verifier.cache, capacity, DraftShape(4), cape, params)
    draft = drafter.propose([*prompt_ids, root], 1, 1)
    tree = draft.tree
    assert len(tree_children(tree.parent_ids)[0]) > 1  # a real tree: several candidates for the first token
    start = verifier.cache.length
    with torch.inference_mode():
        logits = engine.target_runner.forward(verifier.cache, tree.token_ids, tree.parent_ids)  # [N, V]
    verifier.cache.truncate(start)
    p = logits_to_probs(logits[0].float(), params)  # target's distribution of the first emitted token

    samples = 4000
    counts: Counter[int] = Counter()
    for seed in range(samples):
        outcome = accept_draft(logits, draft, params, seed)
        nodes = outcome.accepted_nodes
        counts[tree.token_ids[nodes[1]] if len(nodes) > 1 else outcome.next_token] += 1
    frequent = [t for t in torch.argsort(p, descending=True).tolist() if p[t] * samples >= 10]
    observed = [counts[t] for t in frequent] + [samples - sum(counts[t] for t in frequent)]
    expected = [float(p[t]) * samples for t in frequent]
    expected.append(samples - sum(expected))
    if expected[-1] < 5:  # too rare a remainder for chi-square: fold it into the last bucket
        observed[-2:] = [sum(observed[-2:])]
        expected[-2:] = [sum(expected[-2:])]
    assert len(frequent) >= 2
    assert chisquare(observed, expected).pvalue > 1e-3
