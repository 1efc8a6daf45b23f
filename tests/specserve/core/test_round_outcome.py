"""A round's outcome (core/protocols.py, RoundOutcome): built from the verifier's answer or, where only
tokens travel, from the tokens committed after the root; every reader's count comes from it."""

from __future__ import annotations

import pytest

from specserve.core.protocols import DraftTree, RoundOutcome, VerifyOutcome
from specserve.core.tree import TokenTree

ROOT = 7
# root 7 -> 10 (spine) -> 11 -> 12; leaves 20 (beside 10) and 21 (beside 11); nodes 2 and 4 from the suffix
LEAFY = DraftTree(TokenTree((ROOT, 10, 20, 11, 21, 12), (-1, 0, 0, 1, 1, 3)), suffix_nodes=frozenset({2, 4}))


@pytest.mark.parametrize(
    "committed,nodes,next_token",
    [
        ([10, 11, 12, 30], (0, 1, 3, 5), 30),  # the whole spine, then the bonus
        ([10, 21, 31], (0, 1, 4), 31),  # through a leaf at depth 2
        ([20, 31], (0, 2), 31),
        ([31], (0,), 31),  # the first token rejected, the recovered token instead
        ([10, 11], (0, 1, 3), None),  # a round that committed no next token (target-rooted)
    ],
)
def test_the_committed_tokens_walk_the_tree_along_the_accepted_path(committed, nodes, next_token):
    outcome = RoundOutcome.from_committed(LEAFY, committed)
    assert outcome.accepted_nodes == nodes and outcome.next_token == next_token
    assert outcome.emitted_token_ids == committed
    assert outcome == RoundOutcome.of(LEAFY, VerifyOutcome(list(nodes), next_token))


def test_counts_of_drafted_and_suffix_tokens():
    outcome = RoundOutcome.from_committed(LEAFY, [10, 21, 31])
    assert outcome.num_accepted_tokens == 2
    assert (outcome.num_suffix_draft_tokens, outcome.num_suffix_accepted_tokens) == (2, 1)
    assert outcome.accepted_token_ids == [10, 21]


def test_a_target_rooted_path_does_not_count_the_targets_own_candidate():
    seeded = DraftTree(TokenTree((ROOT, 40, 41, 42), (-1, 0, 0, 1)), target_roots=2)
    outcome = RoundOutcome.of(seeded, VerifyOutcome([0, 1, 3], None, root_candidates=(5, 6)))
    assert outcome.num_accepted_tokens == 1 and outcome.emitted_token_ids == [40, 42]
