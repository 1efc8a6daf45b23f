"""Verification rules: hand-built greedy cases, and statistical proof that sampling is lossless.

The statistical tests build random conditional distributions p (target) and q (draft) over a small
vocabulary, draw draft trees from q exactly as a drafter would, verify them, and compare the joint
distribution of the first two emitted tokens with p(x1) p(x2 | x1) by a chi-square test.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from scipy.stats import chisquare

from specserve.core.protocols import CandidateKind
from specserve.core.sampling import make_generator
from specserve.core.tree import TokenTree
from specserve.core.verify import verify_greedy, verify_sampled

V = 4  # vocabulary size of the statistical tests


def _one_hot_argmax(*tokens: int) -> Callable[[int], int]:
    """The target's argmax at each node, as the walk asks for it."""
    return list(tokens).__getitem__


def test_greedy_all_accepted_gives_bonus():
    tree = TokenTree.chain([9, 1, 2, 3])
    out = verify_greedy(_one_hot_argmax(1, 2, 3, 7), tree.parent_ids, tree.token_ids)
    assert out.accepted_nodes == [0, 1, 2, 3] and out.next_token == 7


def test_greedy_first_token_rejected():
    tree = TokenTree.chain([9, 1, 2])
    out = verify_greedy(_one_hot_argmax(5, 2, 3), tree.parent_ids, tree.token_ids)
    assert out.accepted_nodes == [0] and out.next_token == 5


def test_greedy_empty_draft():
    tree = TokenTree((9,), (-1,))
    out = verify_greedy(_one_hot_argmax(4), tree.parent_ids, tree.token_ids)
    assert out.accepted_nodes == [0] and out.next_token == 4


def test_greedy_follows_the_matching_branch():
    # root -> {a=1, b=2}; b -> c=3. The target wants 2 then 3 then 8: path root, b, c; bonus 8.
    tree = TokenTree((9, 1, 2, 3), (-1, 0, 0, 2))
    out = verify_greedy(_one_hot_argmax(2, 0, 3, 8), tree.parent_ids, tree.token_ids)
    assert out.accepted_nodes == [0, 2, 3] and out.next_token == 8


def _dist(prefix: tuple[int, ...], salt: int, sharpness: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((prefix, salt)) % (2**31))
    return torch.softmax(torch.randn(V, generator=g) * sharpness, -1)


def _target(prefix: tuple[int, ...]) -> torch.Tensor:
    return _dist(prefix, 1, 1.5)


def _draft(prefix: tuple[int, ...]) -> torch.Tensor:
    return _dist(prefix, 2, 1.0)


def _draw_tree(kind: CandidateKind, widths: tuple[int, ...], g: torch.Generator):
    """Spine + leaves, as ModelDrafter builds it: candidates from q at each depth, first one continues."""
    tokens, parents, prefixes, q_of = [0], [-1], [()], {}
    parent = 0
    for width in widths:
        q = _draft(prefixes[parent])
        if kind is CandidateKind.FIXED:
            cands = torch.topk(q, width).indices.tolist()
        else:
            replace = kind is CandidateKind.SAMPLED
            cands = torch.multinomial(q, width, replacement=replace, generator=g).tolist()
            q_of[parent] = q
        spine = len(tokens)
        for c in cands:
            tokens.append(c)
            parents.append(parent)
            prefixes.append((*prefixes[parent], c))
        parent = spine
    return tokens, parents, prefixes, q_of


@pytest.mark.compute_only
@pytest.mark.parametrize(
    "kind,widths",
    [
        (CandidateKind.SAMPLED, (1, 1)),  # classic speculative sampling on a chain
        (CandidateKind.SAMPLED, (3, 2)),  # MCSD, with replacement
        (CandidateKind.SAMPLED_WITHOUT_REPLACEMENT, (3, 2)),
        (CandidateKind.FIXED, (1, 1)),
        (CandidateKind.FIXED, (2, 3)),  # CaPE-style top-k leaves
    ],
)
def test_sampled_verification_preserves_target_distribution(kind, widths):
    trials = 12000
    g = make_generator(1234)
    counts = torch.zeros(V, V)
    for _ in range(trials):
        tokens, parents, prefixes, q_of = _draw_tree(kind, widths, g)
        out = verify_sampled(
            lambda node, prefixes=prefixes: _target(prefixes[node]), parents, tokens, q_of, kind, g
        )
        emitted = [tokens[i] for i in out.accepted_nodes[1:]] + [out.next_token]
        if len(emitted) == 1:  # the next round would sample x2 from the target itself
            emitted.append(int(torch.multinomial(_target((emitted[0],)), 1, generator=g)))
        counts[emitted[0], emitted[1]] += 1
    expected = torch.stack([_target(())[a] * _target((a,)) for a in range(V)]) * trials  # [V, V]
    result = chisquare(counts.flatten().numpy(), expected.flatten().numpy())
    assert result.pvalue > 1e-3, f"{kind} {widths}: p={result.pvalue:.2e}"


@pytest.mark.compute_only
def test_biased_rule_is_detected():
    """Guards the test itself: always accepting the draft token must fail the same chi-square check."""
    trials = 12000
    g = make_generator(7)
    counts = torch.zeros(V)
    for _ in range(trials):
        counts[int(torch.multinomial(_draft(()), 1, generator=g))] += 1
    assert chisquare(counts.numpy(), (_target(()) * trials).numpy()).pvalue < 1e-6


def test_sampling_is_seeded():
    tokens, parents, prefixes, q_of = _draw_tree(CandidateKind.SAMPLED, (3, 2), make_generator(0))

    def run(seed: int):
        return verify_sampled(
            lambda n: _target(prefixes[n]), parents, tokens, q_of, CandidateKind.SAMPLED, make_generator(seed)
        )

    assert run(5) == run(5)
    assert len({(tuple(run(s).accepted_nodes), run(s).next_token) for s in range(40)}) > 1
