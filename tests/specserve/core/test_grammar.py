"""Drafts shaped by a constraint's language (core/grammar.py), on a toy language whose allowed tokens
depend only on the position: every rule can be checked by hand."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.core.finish import FinishChecker
from specserve.core.grammar import forced_draft, shape_draft
from specserve.core.loop import speculative_generate
from specserve.core.protocols import READS_NOTHING, CandidateKind, DraftTree, RoundOutcome, VerifyOutcome
from specserve.core.tree import TokenTree, tree_children


class PositionalLanguage:
    """allowed[i]: the tokens allowed at generated position i (past the end: nothing)."""

    def __init__(self, allowed: Sequence[set[int]], max_tree_nodes: int = 64) -> None:
        self.allowed = list(allowed)
        self.max_tree_nodes = max_tree_nodes
        self.position = 0

    def sync(self, token_ids: Sequence[int]) -> None:
        raise AssertionError("shaping never syncs")

    def push(self, tokens: Sequence[int]) -> None:
        assert self.allowed_prefix(tokens) == len(tokens), "pushed a forbidden token"
        self.position += len(tokens)

    def pop(self, count: int) -> None:
        self.position -= count
        assert self.position >= 0

    def allowed_prefix(self, tokens: Sequence[int]) -> int:
        for i, token in enumerate(tokens):
            at = self.position + i
            if at >= len(self.allowed) or token not in self.allowed[at]:
                return i
        return len(tokens)

    def forced(self) -> list[int]:
        out = []
        for options in self.allowed[self.position :]:
            if len(options) != 1:
                break
            out.append(next(iter(options)))
        return out


def test_forced_draft_is_the_forced_chain_or_none():
    language = PositionalLanguage([{5}, {6}, {7, 8}])
    draft = forced_draft(9, language)
    assert draft is not None
    assert draft.tree == TokenTree.chain([9, 5, 6])
    assert draft.forced_nodes == {1, 2} and draft.kind is CandidateKind.FIXED
    assert forced_draft(9, PositionalLanguage([{7, 8}, {1}])) is None


def test_forced_draft_respects_the_node_cap():
    draft = forced_draft(9, PositionalLanguage([{1}, {2}, {3}, {4}], max_tree_nodes=3))
    assert draft is not None and draft.tree.token_ids == (9, 1, 2)


def test_shape_draft_drops_forbidden_nodes_with_their_subtrees():
    # root 9 -> {1 (allowed) -> 3 (forbidden at depth 2), 2 (forbidden) -> 4}
    tree = TokenTree((9, 1, 2, 3, 4), (-1, 0, 0, 1, 2))
    language = PositionalLanguage([{1, 7}, {4, 5}])
    shaped = shape_draft(DraftTree(tree, suffix_nodes=frozenset({1, 2})), language)
    assert shaped.tree == TokenTree((9, 1), (-1, 0))
    assert shaped.suffix_nodes == {1}  # node ids follow the shaped tree
    assert language.position == 0  # the walk pops what it pushed


def test_shape_draft_extends_the_spine_leaf_with_what_is_forced():
    # root 9 -> {1 -> 2, 3}; after 1, 2 the language forces 5, 6. The second child 3 is not extended.
    tree = TokenTree((9, 1, 2, 3), (-1, 0, 1, 0))
    language = PositionalLanguage([{1, 3}, {2}, {5}, {6}, {7, 8}])
    shaped = shape_draft(DraftTree(tree), language)
    assert shaped.tree == TokenTree((9, 1, 2, 5, 6, 3), (-1, 0, 1, 2, 3, 0))
    assert shaped.forced_nodes == {3, 4}


def test_shape_draft_spine_moves_to_the_first_allowed_child():
    tree = TokenTree((9, 1, 2), (-1, 0, 0))  # the first child (1) is forbidden: 2 is the spine now
    shaped = shape_draft(DraftTree(tree), PositionalLanguage([{2}, {4}]))
    assert shaped.tree == TokenTree((9, 2, 4), (-1, 0, 1)) and shaped.forced_nodes == {2}


def test_shape_draft_keeps_the_node_cap():
    tree = TokenTree.chain([9, 1, 2])
    shaped = shape_draft(DraftTree(tree), PositionalLanguage([{1}, {2}, {3}, {4}, {5}], max_tree_nodes=4))
    assert shaped.tree.token_ids == (9, 1, 2, 3)


def test_shape_draft_returns_an_unchanged_draft_itself():
    draft = DraftTree(TokenTree((9, 1, 2), (-1, 0, 0)))
    assert shape_draft(draft, PositionalLanguage([{1, 2}, {3, 4}])) is draft


def test_shape_draft_leaves_sampled_candidates_as_drawn():
    # Dropping a draw would change the distribution the acceptance rule assumes: the target's mask
    # rejects a forbidden draw instead.
    q = {0: torch.tensor([0.5, 0.5])}
    draft = DraftTree(TokenTree((9, 0, 1), (-1, 0, 0)), CandidateKind.SAMPLED, q)
    assert shape_draft(draft, PositionalLanguage([{1}])) is draft


class RecordingDrafter:
    """A drafter proposing a fixed chain, recording what it is asked and told."""

    reads = READS_NOTHING

    def __init__(self, chain: list[int]) -> None:
        self.chain = chain
        self.proposed_for: list[int] = []
        self.observed: list[RoundOutcome] = []

    def propose(self, token_ids, round_seed, batch_sessions) -> DraftTree:
        self.proposed_for.append(len(token_ids))
        return DraftTree(TokenTree.chain([token_ids[-1], *self.chain]))

    def observe(self, outcome: RoundOutcome) -> None:
        self.observed.append(outcome)

    def release(self) -> None:
        pass


class ChainVerifier:
    """A target whose greedy choice after `prompt + i` generated tokens is `text[i]`."""

    def __init__(self, text: list[int]) -> None:
        self.text = text
        self.generated = 0

    def prefill(self, prompt_ids, round_seed) -> int:
        self.generated = 1
        return self.text[0]

    def resume(self, token_ids) -> None:
        raise AssertionError("not resumed")

    def verify(self, draft: DraftTree, round_seed: int) -> VerifyOutcome:
        path, node = [0], 0
        children = tree_children(draft.tree.parent_ids)
        while True:
            wanted = self.text[self.generated + len(path) - 1]
            match = next((c for c in children[node] if draft.tree.token_ids[c] == wanted), None)
            if match is None:
                self.generated += len(path)
                return VerifyOutcome(path, wanted)
            node = match
            path.append(node)

    def release(self) -> None:
        pass


class SyncingLanguage(PositionalLanguage):
    """PositionalLanguage that follows the committed text (the loop syncs it every round)."""

    def __init__(self, allowed, num_prompt_tokens: int) -> None:
        super().__init__(allowed)
        self.num_prompt_tokens = num_prompt_tokens

    def sync(self, token_ids) -> None:
        self.position = len(token_ids) - self.num_prompt_tokens


def test_the_loop_drafts_forced_rounds_itself_and_the_drafter_sees_its_own_rounds():
    # The target writes 10 11 12 13 14 EOS(0); the language forces 11 12 after 10, then allows choices.
    text = [10, 11, 12, 13, 14, 0, 5]
    language = SyncingLanguage([{10}, {11}, {12}, {13, 7}, {14, 8}, {0}], num_prompt_tokens=2)
    drafter = RecordingDrafter([14, 0])
    finish = FinishChecker(16, frozenset({0}))
    stats = speculative_generate([1, 2], ChainVerifier(text), drafter, 0, finish, grammar=language)
    assert finish.generated == text[:6]
    # Round 1 (after 10) is the forced chain 11 12: the drafter is not asked; round 2 (after 13) asks it.
    assert drafter.proposed_for == [6]
    assert stats.num_forced_accepted_tokens == 2 and stats.num_target_forwards == 3
    # The drafter observes a root-only round for the forced one, and its own chain for its round.
    assert [o.draft.tree.num_nodes for o in drafter.observed] == [1, 3]
