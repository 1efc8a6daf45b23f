"""A draft session reads its drafter's round from the committed tokens, as the in-process loop reports it.

The router runs the loop and sends tokens, so the draft service learns how its last tree's round went from
the tokens committed after that tree's root. Rounds without a Propose call (a suffix candidates' round,
a round skipped under load) may follow that round: the router then says how many tokens the round
committed (ProposeRequest.last_round_committed), and the drafter observes exactly that round.
"""

from __future__ import annotations

import torch

from services.draft.mirror import KVMirror
from services.draft.sessions import DraftSession
from specserve.core.protocols import READS_NOTHING, CandidateKind, DraftTree, RoundOutcome
from specserve.core.tree import TokenTree

ROOT = 5
# The root, a spine of two tokens (11, 12) and a leaf beside the first (13): depth 2.
TREE = DraftTree(TokenTree((ROOT, 11, 13, 12), (-1, 0, 0, 1)), CandidateKind.FIXED)
PROMPT = [1, 2, 3, ROOT]


class ObservingDrafter:
    """Records the outcomes its session reports; drafts nothing (the session's bookkeeping is under test)."""

    reads = READS_NOTHING

    def __init__(self) -> None:
        self.outcomes: list[RoundOutcome] = []

    def propose(self, token_ids, round_seed, batch_sessions):  # pragma: no cover - never asked here
        raise AssertionError("not asked to draft")

    def observe(self, outcome: RoundOutcome) -> None:
        self.outcomes.append(outcome)

    def release(self) -> None:
        pass


def session_after_its_tree() -> tuple[DraftSession, ObservingDrafter]:
    drafter = ObservingDrafter()
    session = DraftSession(
        "s", "glide-cape", list(PROMPT), drafter, KVMirror([-1], 2, 64, torch.device("cpu")), None
    )
    session.proposed_root, session.last_draft = len(PROMPT) - 1, TREE
    return session, drafter


def test_a_round_read_from_its_tokens_alone() -> None:
    session, drafter = session_after_its_tree()
    session.observe_committed([*PROMPT, 11, 99])  # the first spine token accepted, then the target's
    (outcome,) = drafter.outcomes
    assert outcome.emitted_token_ids == [11, 99] and outcome.accepted_nodes == (0, 1)


def test_tokens_of_rounds_without_a_call_after_it_tell_nothing_without_the_routers_count() -> None:
    session, drafter = session_after_its_tree()
    # one token from the tree's round, then four from a suffix round the draft was not asked for: more
    # than a round of this tree can commit, so which were this round's is unknown
    session.observe_committed([*PROMPT, 99, 7, 8, 9, 10])
    assert drafter.outcomes == []


def test_the_routers_count_says_which_tokens_were_the_trees_round() -> None:
    session, drafter = session_after_its_tree()
    session.last_round_committed = 1
    session.observe_committed([*PROMPT, 99, 7, 8, 9, 10])
    (outcome,) = drafter.outcomes
    assert outcome.emitted_token_ids == [99] and outcome.accepted_nodes == (0,)
    # Read once: the next call's tokens are another round's.
    assert session.last_round_committed is None


def test_a_count_the_tokens_cannot_hold_tells_nothing() -> None:
    session, drafter = session_after_its_tree()
    session.last_round_committed = 3
    session.observe_committed([*PROMPT, 11, 99])
    assert drafter.outcomes == []
