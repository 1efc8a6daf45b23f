"""Drafting under a constraint (runtime/drafter.py, grow_spine_tree with SpineMasks): every candidate and
every draft distribution stays inside the language, at every depth, and the drafter's grammar state is
back at the committed text after the round."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from specserve.core.protocols import CandidateKind
from specserve.core.sampling_params import GREEDY, SamplingParams
from specserve.grammar.masks import SpineMasks
from specserve.runtime.drafter import grow_spine_tree

V = 40


class DepthLanguage:
    """allowed[i]: the tokens allowed at generated position i; a toy GrammarState with llguidance's
    bitmask layout (bit t of little-endian 32-bit words)."""

    def __init__(self, allowed: Sequence[set[int]]) -> None:
        self.allowed = list(allowed)
        self.max_tree_nodes = 64
        self.position = 0
        self.synced: list[Sequence[int]] = []

    def sync(self, token_ids: Sequence[int]) -> None:
        self.synced.append(list(token_ids))

    def push(self, tokens: Sequence[int]) -> None:
        assert all(t in self.allowed[self.position + i] for i, t in enumerate(tokens)), (
            "pushed a forbidden token"
        )
        self.position += len(tokens)

    def pop(self, count: int) -> None:
        self.position -= count

    def allowed_prefix(self, tokens: Sequence[int]) -> int:
        raise AssertionError("drafting does not validate")

    def forced(self) -> list[int]:
        raise AssertionError("drafting does not ask for forced tokens")

    def bitmask(self) -> bytes:
        words = [0] * ((V + 31) // 32)
        for token in self.allowed[self.position] if self.position < len(self.allowed) else ():
            words[token // 32] |= 1 << (token % 32)
        return b"".join(w.to_bytes(4, "little") for w in words)


def _grow(language: DepthLanguage, params: SamplingParams, kind: CandidateKind, width: int = 3):
    logits = torch.randn(V, generator=torch.Generator().manual_seed(0))  # the draft prefers anything
    seen: list[torch.Tensor] = []

    def advance(spine_token: int, depth_index: int) -> torch.Tensor:
        return torch.randn(V, generator=torch.Generator().manual_seed(spine_token + 100 * depth_index))

    def width_at(depth_index: int, depth_logits: torch.Tensor, num_nodes: int) -> int:
        seen.append(depth_logits)
        return width

    masks = SpineMasks(language, [7, 8, 9])
    try:
        draft = grow_spine_tree(
            9, logits, 4, width_at, advance, params, kind, torch.Generator().manual_seed(1), None, masks
        )
    finally:
        masks.release()
    return draft, seen


ALLOWED = [{1, 2, 3, 4}, {5}, {6, 7}, {8, 9, 10}]


@pytest.mark.parametrize(
    ("params", "kind"),
    [
        (GREEDY, CandidateKind.FIXED),
        (SamplingParams(temperature=1.0), CandidateKind.SAMPLED),
        (SamplingParams(temperature=1.0), CandidateKind.SAMPLED_WITHOUT_REPLACEMENT),
    ],
)
def test_every_candidate_and_every_q_is_inside_the_language(params: SamplingParams, kind: CandidateKind):
    language = DepthLanguage(ALLOWED)
    draft, seen = _grow(language, params, kind)
    depths = draft.tree.depths()
    for node in range(1, draft.tree.num_nodes):
        assert draft.tree.token_ids[node] in ALLOWED[depths[node] - 1]
    for node, q in draft.draft_probs.items():  # q of a node's children: zero outside the language
        allowed = torch.zeros(V, dtype=torch.bool)
        allowed[list(ALLOWED[depths[node]])] = True
        assert float(q[~allowed].sum()) == 0.0
    assert all(
        bool(torch.isinf(logits[[t for t in range(V) if t not in ALLOWED[d]]]).all())
        for d, logits in enumerate(seen)
    )
    # depth 1 allows one token only: that depth has one candidate
    assert depths.count(2) == 1
    assert language.position == 0 and language.synced == [[7, 8, 9]]


def test_the_spine_ends_where_the_language_allows_nothing():
    language = DepthLanguage(ALLOWED[:2])
    draft, _ = _grow(language, GREEDY, CandidateKind.FIXED)
    assert max(draft.tree.depths()) == 2
    assert language.position == 0
