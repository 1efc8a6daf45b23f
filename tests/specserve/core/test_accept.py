"""Acceptance under a constraint (core/accept.py): each visited node's distribution is the target's,
masked to what the constraint allows there; the emitted tokens follow that masked distribution."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specserve.core.accept import accept_draft, choose_token
from specserve.core.protocols import CandidateKind, DraftTree
from specserve.core.sampling import make_generator
from specserve.core.sampling_params import GREEDY, SamplingParams
from specserve.core.tree import TokenTree

V = 6
LOGITS = torch.tensor([[3.0, 2.0, 1.0, 0.5, 0.0, -1.0], [0.0, 2.5, 2.0, 0.0, 1.0, 0.0]])  # [2, V]
ALLOWED = [torch.tensor([False, True, True, False, True, False]), torch.tensor([True] * V)]  # per depth


class DepthMasks:
    """NodeMasks by depth (ALLOWED), recording the nodes asked for. `quick` False answers every `allows`
    with no, so each visited row is decided by its whole mask: the rule without the shortcut."""

    def __init__(self, tree: TokenTree, visited: list[int], masks=ALLOWED, quick: bool = True) -> None:
        self.depths, self.visited, self.masks, self.quick = tree.depths(), visited, masks, quick

    def allowed(self, node: int) -> torch.Tensor:
        if not self.visited or self.visited[-1] != node:
            self.visited.append(node)
        return self.masks[self.depths[node]]

    def allows(self, node: int, token: int) -> bool:
        return self.quick and bool(self.allowed(node)[token])


def _allowed_at(tree: TokenTree, visited: list[int]) -> DepthMasks:
    return DepthMasks(tree, visited)


def test_greedy_takes_the_best_allowed_token():
    # Unmasked the target's argmax at the root is 0; the constraint forbids it, so 1 is accepted, then
    # at depth 1 (everything allowed) the bonus is the argmax there.
    tree = TokenTree.chain([9, 1])
    visited: list[int] = []
    outcome = accept_draft(LOGITS, DraftTree(tree), GREEDY, 0, _allowed_at(tree, visited))
    assert outcome.accepted_nodes == [0, 1] and outcome.next_token == 1
    assert visited == [0, 1]  # the walk asks only for the nodes it visits, in order
    unconstrained = accept_draft(LOGITS, DraftTree(tree), GREEDY, 0)
    assert unconstrained.accepted_nodes == [0] and unconstrained.next_token == 0


def test_greedy_without_building_masks_is_the_masked_argmax():
    # Random rows, masks and trees (ties included: logits from a few values): where a row's own argmax
    # is allowed no mask is built, and the outcome is the one every row's whole mask gives.
    g = torch.Generator().manual_seed(5)
    for _ in range(300):
        depth = int(torch.randint(1, 5, (), generator=g))
        masks = [torch.rand(V, generator=g) < 0.6 for _ in range(depth + 1)]
        for mask in masks:
            mask[int(torch.randint(V, (), generator=g))] = True
        tree = TokenTree.chain([9, *torch.randint(V, (depth,), generator=g).tolist()])
        logits = torch.randint(0, 3, (depth + 1, V), generator=g).float()  # [N, V]
        quick = accept_draft(logits, DraftTree(tree), GREEDY, 0, DepthMasks(tree, [], masks))
        whole = accept_draft(logits, DraftTree(tree), GREEDY, 0, DepthMasks(tree, [], masks, quick=False))
        assert (quick.accepted_nodes, quick.next_token) == (whole.accepted_nodes, whole.next_token)
        assert masks[len(quick.accepted_nodes) - 1][quick.next_token]


def test_choose_token_masks():
    assert choose_token(LOGITS[0], GREEDY, 0) == 0
    assert choose_token(LOGITS[0], GREEDY, 0, ALLOWED[0]) == 1


def _masked_target() -> torch.Tensor:
    return torch.softmax(LOGITS[0].masked_fill(~ALLOWED[0], float("-inf")), -1)  # [V]


@pytest.mark.parametrize("kind", [CandidateKind.FIXED, CandidateKind.SAMPLED])
def test_sampled_tokens_follow_the_masked_distribution(kind: CandidateKind):
    # Drafts that put mass on a forbidden token (0) and on allowed ones: the first emitted token must
    # follow the masked target whatever was drafted (chi-square over many seeds). Sampled candidates are
    # drawn from q each trial, as the rule assumes; fixed ones are the same two every time.
    q = torch.tensor([0.5, 0.0, 0.3, 0.0, 0.0, 0.2])  # [V]
    params = SamplingParams(temperature=1.0)
    trials = 6000
    counts = torch.zeros(V)
    draws = make_generator(11)
    for seed in range(trials):
        if kind is CandidateKind.SAMPLED:
            children = torch.multinomial(q, 2, replacement=True, generator=draws).tolist()
        else:
            children = [0, 2]
        tree = TokenTree((9, *children), (-1, 0, 0))
        draft = DraftTree(tree, kind, {0: q} if kind is CandidateKind.SAMPLED else {})
        outcome = accept_draft(LOGITS[tree.depths()], draft, params, seed, _allowed_at(tree, []))
        first = (
            tree.token_ids[outcome.accepted_nodes[1]]
            if len(outcome.accepted_nodes) > 1
            else outcome.next_token
        )
        assert first is not None
        counts[first] += 1
    expected = _masked_target() * trials
    assert counts[~ALLOWED[0]].sum() == 0, "a forbidden token was emitted"
    support = ALLOWED[0]
    result = chisquare(counts[support].numpy(), expected[support].numpy())
    assert result.pvalue > 1e-3, f"p={result.pvalue:.2e}"


def test_the_chi_square_check_detects_the_drafts_distribution():
    """Guards the test above: tokens drawn from the masked draft instead fail the same check."""
    g = make_generator(3)
    q = torch.tensor([0.0, 0.0, 0.6, 0.0, 0.4, 0.0])  # the draft's allowed mass, renormalised
    counts = torch.zeros(V)
    for _ in range(6000):
        counts[int(torch.multinomial(q, 1, generator=g))] += 1
    support = ALLOWED[0]
    assert chisquare(counts[support].numpy(), (_masked_target() * 6000)[support].numpy()).pvalue < 1e-6
