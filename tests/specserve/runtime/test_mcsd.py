"""MCSD and target-initialised MCSD on tiny random models: tree shapes, level-by-level draft forwards,
lossless greedy and sampling, the lossy variant's refusal-worthy bias, measured."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from scipy.stats import chisquare
from seeded_runs import seeded_runs
from tiny_llama import noisy_copy, tiny_llama
from tree_paths import path_to_node

from specserve.core.finish import FinishChecker
from specserve.core.loop import speculative_generate
from specserve.core.protocols import CandidateKind, DraftTree
from specserve.core.sampling import logits_to_probs
from specserve.core.sampling_params import SamplingParams
from specserve.core.sliced_mask import multi_candidate_parents
from specserve.core.stopping import DraftStep
from specserve.core.tree import TokenTree, tree_children
from specserve.errors import FailedPrecondition, InvalidArgument
from specserve.runtime.mcsd import McsdShape, MultiCandidateDrafter
from specserve.runtime.runner import ModelRunner
from specserve.runtime.target import LocalVerifier

PROMPT = [3, 17, 5, 9, 41, 2, 33, 8]
CAPACITY = 256
GREEDY = SamplingParams()


def run(target, drafter, params, seed=0, prompt=PROMPT, max_new_tokens=40):
    finish = FinishChecker(max_new_tokens, frozenset())
    verifier = LocalVerifier(target, CAPACITY, sampling=params)
    stats = speculative_generate(prompt, verifier, drafter, seed, finish)
    return finish.generated, stats


SHAPES = [
    McsdShape((2, 2, 1)),
    McsdShape((3,)),
    McsdShape((1, 1, 1, 1)),
    McsdShape((2, 2, 1, 1), target_roots=True),
    McsdShape((3, 1, 1), target_roots=True),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s.k_config}{'-target' if s.target_roots else ''}")
def test_greedy_output_equals_target_alone(target, draft, shape):
    reference, _ = run(target, None, GREEDY)
    generated, stats = run(target, MultiCandidateDrafter(draft, CAPACITY, shape), GREEDY)
    assert generated == reference
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_tree_is_the_full_static_shape_with_the_drafts_top_k(target, draft):
    drafter = MultiCandidateDrafter(draft, CAPACITY, McsdShape((2, 2, 1)))
    tree = drafter.propose(PROMPT, 0, 1).tree
    assert tree.parent_ids == multi_candidate_parents((2, 2, 1))
    # each node's children are the draft's top-k after the path to it (checked by a fresh causal forward)
    for node, children in enumerate(tree_children(tree.parent_ids)):
        if not children:
            continue
        path = [tree.token_ids[i] for i in path_to_node(tree.parent_ids, node)]
        with torch.inference_mode():
            logits = draft.model(torch.tensor([PROMPT[:-1] + path])).logits[0, -1]
        top = torch.topk(logits, len(children)).indices.tolist()
        assert [tree.token_ids[c] for c in children] == top, node


class StopAfter:
    """Stops after `levels` levels; records the steps it is asked about."""

    def __init__(self, levels: int) -> None:
        self.levels, self.max_depth = levels, 40
        self.steps: list[DraftStep] = []

    def should_stop(self, step: DraftStep) -> bool:
        self.steps.append(step)
        return step.depth_index + 1 == self.levels

    def observe(self, num_drafted: int, num_accepted: int) -> None: ...


@pytest.mark.parametrize("levels", [1, 2])
def test_a_stop_slices_the_tree_after_that_level(draft, levels):
    drafter = MultiCandidateDrafter(draft, CAPACITY, McsdShape((2, 2, 1)))
    drafter.stop_policy = StopAfter(levels)
    tree = drafter.propose(PROMPT, 0, 1).tree
    assert tree.parent_ids == multi_candidate_parents((2, 2, 1)[:levels])
    assert drafter.cache.length == len(PROMPT)  # the tree's draft KV is gone, the root's stays
    # the policy saw the first child of each level's first node: the spine
    assert [s.token for s in drafter.stop_policy.steps] == [tree.token_ids[n] for n in (1, 3)[:levels]]


def test_draft_cache_is_reused_across_rounds(draft):
    drafter = MultiCandidateDrafter(draft, CAPACITY, McsdShape((2, 2)))
    first = drafter.propose(PROMPT, 0, 1)
    again = drafter.propose([*PROMPT, 7, 11], 0, 1)
    fresh = MultiCandidateDrafter(draft, CAPACITY, McsdShape((2, 2))).propose([*PROMPT, 7, 11], 0, 1)
    assert again.tree == fresh.tree and first.tree != again.tree


@pytest.mark.parametrize("kind", [CandidateKind.SAMPLED, CandidateKind.SAMPLED_WITHOUT_REPLACEMENT])
def test_sampled_trees_carry_q_of_every_internal_node(draft, kind):
    params = SamplingParams(temperature=1.0)
    shape = McsdShape((3, 2), sampled_kind=kind)
    proposal = MultiCandidateDrafter(draft, CAPACITY, shape, params).propose(PROMPT, 4, 1)
    internal = [i for i, c in enumerate(tree_children(proposal.tree.parent_ids)) if c]
    assert proposal.kind is kind and sorted(proposal.draft_probs) == internal
    if kind is CandidateKind.SAMPLED_WITHOUT_REPLACEMENT:
        for node in internal:
            tokens = [proposal.tree.token_ids[c] for c in tree_children(proposal.tree.parent_ids)[node]]
            assert len(set(tokens)) == len(tokens)


def test_target_rooted_rounds_hand_over_the_targets_top_w(target, draft):
    shape = McsdShape((2, 2, 1), target_roots=True)
    drafter = MultiCandidateDrafter(draft, CAPACITY, shape)
    verifier = LocalVerifier(target, CAPACITY)
    root = verifier.prefill(PROMPT, 0)
    first = drafter.propose([*PROMPT, root], 0, 1)
    assert first.tree.num_nodes == 1 and first.target_roots == 2 and first.num_draft_tokens == 0
    outcome = verifier.verify(first, 0)
    with torch.inference_mode():
        logits = target.model(torch.tensor([[*PROMPT, root]])).logits[0, -1]
    assert outcome.next_token is None and outcome.accepted_nodes == [0]
    assert list(outcome.root_candidates) == torch.topk(logits, 2).indices.tolist()
    assert verifier.cache.length == len(PROMPT)  # the root stays the root: its KV is not committed
    seeded = drafter.propose_from_roots([*PROMPT, root], outcome.root_candidates, 0, 1)
    first_level = tree_children(seeded.tree.parent_ids)[0]
    assert [seeded.tree.token_ids[c] for c in first_level] == list(outcome.root_candidates)
    assert seeded.num_seeded == 2 and seeded.num_draft_tokens == seeded.tree.num_nodes - 3
    second = verifier.verify(seeded, 0)
    assert second.accepted_nodes[1] == 1  # the target's argmax is its first candidate


def test_root_candidates_need_a_seeded_drafter_and_a_target_shape(target, draft):
    class RootOnlyOnce:
        """A drafter asking for root candidates but unable to use them."""

        def propose(self, token_ids: Sequence[int], round_seed: int, batch_sessions: int) -> DraftTree:
            return DraftTree(TokenTree.chain([token_ids[-1]]), target_roots=2)

        def observe(self, outcome) -> None: ...

        def release(self) -> None: ...

    with pytest.raises(FailedPrecondition):
        run(target, RootOnlyOnce(), GREEDY)
    with pytest.raises(InvalidArgument):
        MultiCandidateDrafter(draft, CAPACITY, McsdShape((2, 2))).propose_from_roots(PROMPT, [1, 2], 0, 1)
    with pytest.raises(InvalidArgument):
        McsdShape((2, 2), target_roots=True, stop="svip")


# --- statistics on a 4-token vocabulary -----------------------------------------------------------

V = 4
SMALL_PROMPT = [1, 2, 3, 0, 1]
SAMPLING = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def small_target() -> ModelRunner:
    return ModelRunner(tiny_llama(vocab_size=V, hidden=16, layers=1, seed=3))


@pytest.fixture(scope="module")
def small_draft(small_target) -> ModelRunner:
    return ModelRunner(noisy_copy(small_target.model, scale=1.0, seed=4))


def second_token_distribution(model, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """P(x2) [V] under the target alone: x1 (the prefill's token) summed out exactly."""

    def probs(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return logits_to_probs(model(torch.tensor([ids])).logits[0, -1], params)

    p1 = probs(prompt)
    return sum(p1[x1] * probs([*prompt, x1]) for x1 in range(V))


def second_token_counts(small_target, small_draft, shape: McsdShape, trials: int) -> torch.Tensor:
    """Token 2 is the first one a speculative round decides (token 1 comes from the prefill)."""

    def second_token(seed: int) -> int:
        drafter = MultiCandidateDrafter(small_draft, CAPACITY, shape, SAMPLING)
        generated, _ = run(small_target, drafter, SAMPLING, seed=seed, prompt=SMALL_PROMPT, max_new_tokens=2)
        return generated[1]

    counts = torch.zeros(V)
    for token in seeded_runs(second_token, trials):
        counts[token] += 1
    return counts


LOSSLESS_SHAPES = [
    McsdShape((2, 2), sampled_kind=CandidateKind.SAMPLED),
    McsdShape((3, 2), sampled_kind=CandidateKind.SAMPLED_WITHOUT_REPLACEMENT),
    McsdShape((2, 2), sampled_kind=CandidateKind.FIXED),
    McsdShape((1, 2, 1), target_roots=True),  # one root: the target's own sample, nothing to choose
]


@pytest.mark.compute_only
@pytest.mark.parametrize("shape", LOSSLESS_SHAPES, ids=lambda s: f"{s.sampled_kind}-{s.k_config}")
def test_sampling_preserves_the_target_distribution(small_target, small_draft, shape):
    trials = 2000
    counts = second_token_counts(small_target, small_draft, shape, trials)
    expected = second_token_distribution(small_target.model, SMALL_PROMPT, SAMPLING) * trials
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3


@pytest.mark.compute_only
def test_two_target_roots_at_t_above_0_are_biased(small_target, small_draft):
    """Choosing the root whose continuation gets furthest shifts the token's distribution: the reason
    mcsd-target-init is labelled lossy. docs/adaptive.md reports the size of the shift."""
    trials = 3000
    counts = second_token_counts(small_target, small_draft, McsdShape((2, 1, 1), target_roots=True), trials)
    p = second_token_distribution(small_target.model, SMALL_PROMPT, SAMPLING)
    assert chisquare(counts.numpy(), (p * trials).numpy()).pvalue < 1e-3
    total_variation = 0.5 * float((counts / trials - p).abs().sum())
    assert total_variation > 0.02
