"""EagleDrafter in the speculative loop: lossless greedy and sampling, the target's hidden states kept
exactly for committed positions, and proposals that follow the documented position convention; greedy,
sampling and the kept states also on the Qwen2 tiny target."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from seeded_runs import seeded_runs
from tiny_llama import EACH_ARCHITECTURE, exact_joint_of_tokens_2_and_3, tiny_model

from specserve.core.cape import CapeSettings
from specserve.core.finish import FinishChecker
from specserve.core.loop import speculative_generate
from specserve.core.sampling_params import SamplingParams
from specserve.eagle.drafter import EagleDrafter
from specserve.eagle.model import EagleDraft, build_eagle
from specserve.errors import FailedPrecondition
from specserve.models.tiny import Architecture
from specserve.runtime.drafter import DraftShape, spine_token_ids
from specserve.runtime.runner import ModelRunner
from specserve.runtime.target import LocalVerifier

PROMPT = [3, 17, 5, 9, 41, 2, 33, 8]
CAPACITY = 256
GREEDY = SamplingParams()


def _eagle(target_model, seed: int = 0, std: float = 0.3, **overrides) -> EagleDraft:
    draft = build_eagle(target_model, seed=seed, **overrides)
    draft.init_weights(torch.Generator().manual_seed(seed), std=std)
    return draft


@pytest.fixture(scope="module")
def target(architecture):
    return ModelRunner(tiny_model(architecture))


def run(target, model, shape, cape, params, seed=0, prompt=PROMPT, max_new_tokens=40):
    verifier = LocalVerifier(target, CAPACITY, sampling=params)
    drafter = None
    if model is not None:
        drafter = EagleDrafter(model, verifier.cache, CAPACITY, shape, cape, params)
    finish = FinishChecker(max_new_tokens, frozenset())
    stats = speculative_generate(prompt, verifier, drafter, seed, finish)
    return finish.generated, stats, verifier


CASES = {
    "chain": (DraftShape(depth=4), None, {"draft_vocab_size": None}),
    "cape": (DraftShape(depth=4), CapeSettings(), {"draft_vocab_size": None}),
    "cape-reduced-head": (DraftShape(depth=3), CapeSettings(max_tree_nodes=6), {"draft_vocab_size": 16}),
}
GREEDY_CASES = [(Architecture.LLAMA, case) for case in CASES] + [(Architecture.QWEN2, "cape")]


@pytest.mark.parametrize(("architecture", "case"), GREEDY_CASES, ids=str, scope="module")
def test_greedy_output_equals_target_alone(target, case):
    shape, cape, overrides = CASES[case]
    reference, _, _ = run(target, None, None, None, GREEDY)
    generated, stats, _verifier = run(target, _eagle(target.model, **overrides), shape, cape, GREEDY)
    assert generated == reference
    assert stats.num_draft_tokens > 0


@EACH_ARCHITECTURE
def test_committed_hidden_states_equal_a_plain_forward_over_the_committed_tokens(target):
    """After rounds of tree verification and commits, the kept states are the ones the LM head reads."""
    verifier = LocalVerifier(target, CAPACITY)
    drafter = EagleDrafter(
        _eagle(target.model, draft_vocab_size=None), verifier.cache, CAPACITY, cape=CapeSettings()
    )
    finish = FinishChecker(24, frozenset())
    speculative_generate(PROMPT, verifier, drafter, 0, finish)
    committed = verifier.token_ids[:-1]
    with torch.inference_mode():
        expected = target.model.model(torch.tensor([committed])).last_hidden_state  # [1, L, H]
    kept = verifier.cache.hidden_states()
    assert kept.shape == expected.shape
    torch.testing.assert_close(kept, expected, atol=1e-4, rtol=1e-4)


@EACH_ARCHITECTURE
@pytest.mark.parametrize("path", ["native", "transformers"])
def test_a_fused_drafts_features_are_its_layers_outputs_side_by_side(target, path):
    """EAGLE-3's input kept by the target through tree rounds and commits: [out_0(t); out_1(t)], where
    out_0 is what transformers reports as hidden_states[1] and the final norm of out_1 is the state its
    LM head reads; on the lean forward and on transformers' own."""
    runner = target
    if path == "transformers":
        runner = ModelRunner(target.model)
        runner.native = None
    elif runner.native is None:
        pytest.skip("no lean forward for this architecture")
    verifier = LocalVerifier(runner, CAPACITY)
    model = _eagle(target.model, draft_vocab_size=None, feature_layers=(0, 1))
    drafter = EagleDrafter(model, verifier.cache, CAPACITY, cape=CapeSettings())
    finish = FinishChecker(24, frozenset())
    reference, _, _ = run(target, None, None, None, GREEDY, max_new_tokens=24)
    stats = speculative_generate(PROMPT, verifier, drafter, 0, finish)
    assert finish.generated == reference and stats.num_draft_tokens > 0
    committed = verifier.token_ids[:-1]
    with torch.inference_mode():
        out = target.model.model(torch.tensor([committed]), output_hidden_states=True)
        kept = verifier.cache.hidden_states()  # [1, L, 2H]
        hidden = target.model.config.hidden_size
        assert kept.shape == (1, len(committed), 2 * hidden)
        torch.testing.assert_close(kept[..., :hidden], out.hidden_states[1], atol=1e-4, rtol=1e-4)
        normed = target.model.model.norm(kept[..., hidden:])
        torch.testing.assert_close(normed, out.last_hidden_state, atol=1e-4, rtol=1e-4)


def test_a_draft_reading_other_features_than_the_target_keeps_is_a_clear_error(target):
    """A fused draft over a cache that keeps final hidden states (two services configured with different
    drafts) stops with FAILED_PRECONDITION, and one cache never keeps two kinds."""
    verifier = LocalVerifier(target, CAPACITY)
    plain = _eagle(target.model, draft_vocab_size=None)
    EagleDrafter(plain, verifier.cache, CAPACITY)
    fused = _eagle(target.model, draft_vocab_size=None, feature_layers=(0, 1))
    with pytest.raises(ValueError, match="keeps the features of layers"):
        EagleDrafter(fused, verifier.cache, CAPACITY)
    root = verifier.prefill(PROMPT, 0)

    class FinalStates:  # what the draft service's mirror is when the target feeds another draft
        def keep_features(self, layers=()) -> None:
            pass

        def hidden_states(self) -> torch.Tensor:
            return verifier.cache.hidden_states()

    with pytest.raises(FailedPrecondition, match="serve both with the same hidden-state draft"):
        EagleDrafter(fused, FinalStates(), CAPACITY).propose([*PROMPT, root], 0, 1)


def test_commit_path_keeps_the_accepted_branchs_states(target):
    verifier = LocalVerifier(target, CAPACITY)
    cache = verifier.cache
    cache.keep_features()
    target.forward(cache, PROMPT)
    start = cache.length
    # root 8 with children 11 and 12; 12 has child 13: accept root -> 12 -> 13 (nodes 0, 2, 3)
    target.forward(cache, [8, 11, 12, 13], [-1, 0, 0, 2])
    cache.commit_path(start, [0, 2, 3])
    with torch.inference_mode():
        expected = target.model.model(torch.tensor([[*PROMPT, 8, 12, 13]])).last_hidden_state
    torch.testing.assert_close(cache.hidden_states(), expected, atol=1e-4, rtol=1e-4)
    cache.truncate(start + 1)
    torch.testing.assert_close(cache.hidden_states(), expected[:, : start + 1], atol=1e-4, rtol=1e-4)


def test_a_round_drafts_from_h_t_and_x_t_plus_1_then_from_its_own_outputs(target):
    """The spine by hand: position t reads (h[t], x[t + 1]); drafted position L + d reads the draft's
    output at L + d - 1 and the token drafted before it, at RoPE position L + d."""
    model = _eagle(target.model, draft_vocab_size=None, std=0.5)
    verifier = LocalVerifier(target, CAPACITY)
    drafter = EagleDrafter(model, verifier.cache, CAPACITY, DraftShape(depth=4))
    root = verifier.prefill(PROMPT, 0)
    token_ids = [*PROMPT, root]
    spine = spine_token_ids(drafter.propose(token_ids, 0, 1).tree)
    features = verifier.cache.hidden_states()  # [1, L, H]
    nexts = token_ids[1:]
    expected: list[int] = []
    with torch.inference_mode():
        for _ in range(4):
            y = model(features, torch.tensor([nexts]))  # [1, n, H], no cache: all positions at once
            token = int(model.logits(y[0, -1]).argmax())
            expected.append(token)
            features = torch.cat([features, y[:, -1:]], dim=1)
            nexts = [*nexts, token]
    assert spine == expected


def test_a_target_without_hidden_states_is_a_clear_error(target):
    verifier = LocalVerifier(target, CAPACITY)
    drafter = EagleDrafter(_eagle(target.model, draft_vocab_size=None), verifier.cache, CAPACITY)
    root = verifier.prefill(PROMPT, 0)
    verifier.cache.features = None  # as a target that never kept them
    with pytest.raises(ValueError):
        drafter.propose([*PROMPT, root], 0, 1)
    other = LocalVerifier(target, CAPACITY)
    EagleDrafter(_eagle(target.model, draft_vocab_size=None), other.cache, CAPACITY)
    root = other.prefill(PROMPT, 0)
    with pytest.raises(FailedPrecondition):  # the root's position is not committed yet
        EagleDrafter(_eagle(target.model, draft_vocab_size=None), other.cache, CAPACITY).propose(
            [*PROMPT, root, 5], 0, 1
        )


V = 4


# Llama only (CI time): on Qwen2 the seeded batched-sampling tests prove the same rule's output.
@pytest.mark.compute_only
@pytest.mark.parametrize("architecture", [Architecture.LLAMA], ids=str)
def test_speculative_sampling_preserves_target_distribution(architecture):
    cape = None  # a sampled chain: the case that needs the draft's q (CaPE's fixed candidates do not)
    small = ModelRunner(tiny_model(architecture, vocab_size=V, hidden=16, layers=1, seed=3))
    model = _eagle(small.model, seed=4, std=1.0, draft_vocab_size=None)
    prompt = [1, 2, 3, 0, 1]
    params = SamplingParams(temperature=1.0)
    trials = 3000

    def tokens(seed: int) -> list[int]:
        return run(small, model, DraftShape(depth=2), cape, params, seed, prompt, 3)[0]

    counts = torch.zeros(V, V)
    for generated in seeded_runs(tokens, trials):
        counts[generated[1], generated[2]] += 1
    expected = exact_joint_of_tokens_2_and_3(small.model, prompt, params, V) * trials
    result = chisquare(counts.flatten().numpy(), expected.flatten().numpy())
    assert result.pvalue > 1e-3, f"p={result.pvalue:.2e}"
