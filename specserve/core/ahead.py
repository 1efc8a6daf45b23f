"""Rounds a target runs on its own after the round it was sent: the loop beside the target.

Through the stack every round is a Verify call, and a call costs a few milliseconds of network,
(de)serialization and hand-offs between threads on both sides: for a small model as much as half a
round. A round that asks no draft model (suffix candidates only, core/suffix_drafter.py) needs
nothing the target does not hold: its candidates come from the session's own text. So the router asks
the target to run such rounds after the one it sends (`AheadVerifier`, VerifyRequest.ahead_rounds),
and they cost a forward each and no call.

Greedy, unconstrained sessions only: greedy output is the target's whatever is drafted, so running a
round here or there changes how fast the text comes, never the text. (A sampled session's tree decides
its draws, and a constrained session's drafts are shaped by a guide the router keeps.) The drafter is
the session's own on the target, over its own tokens: no other session's text reaches it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from specserve.core.protocols import AheadPlan, Drafter, DraftTree, RoundOutcome, VerifyOutcome

Round = tuple[DraftTree, VerifyOutcome]


def committed_tokens(draft: DraftTree, verified: VerifyOutcome) -> list[int]:
    """The tokens a verified round commits: its accepted path after the root, then the next token."""
    return RoundOutcome.of(draft, verified).emitted_token_ids


def run_ahead(
    first: Round,
    token_ids: Callable[[], Sequence[int]],
    drafter: Drafter,
    verify: Callable[[DraftTree], VerifyOutcome],
    plan: AheadPlan,
    max_tokens: int,
    stop_token_ids: frozenset[int],
    expected_tokens: Callable[[], float] = lambda: 0.0,
    admit: Callable[[DraftTree], bool] = lambda draft: True,
    batch_sessions: Callable[[], int] = lambda: 1,
    deadline: float = math.inf,
    clock: Callable[[], float] = time.perf_counter,
) -> list[Round]:
    """`first` (a round already verified), then the rounds `plan` allows, each drafted by `drafter`
    from `token_ids()` (the session's committed tokens, the root last) and verified by `verify`: its
    `rounds` whatever they draft, then its `copy_rounds` while `expected_tokens()` (what the drafter's
    last proposal expects to be accepted) is at least `copy_tokens`; the first that falls short is
    left to the caller's loop, unverified. They stop once `max_tokens` tokens are committed (first's
    included), after a round that commits one of `stop_token_ids`, where `admit` finds no room for a
    round's tree, or at `deadline` on `clock` (no round starts after it: the caller's stream waits for
    these rounds). The drafter observes each round it verified."""
    done = [first]
    made = committed_tokens(*first)
    while (
        len(done) <= plan.total
        and len(made) < max_tokens
        and not stop_token_ids.intersection(made)
        and clock() < deadline
    ):
        draft = drafter.propose(token_ids(), 0, batch_sessions())  # greedy: no seed is read
        if len(done) > plan.rounds and expected_tokens() < plan.copy_tokens:
            break  # a round whose drafter would ask its model: the caller's
        if not admit(draft):
            break
        verified = verify(draft)
        outcome = RoundOutcome.of(draft, verified)
        drafter.observe(outcome)
        done.append((draft, verified))
        made += outcome.emitted_token_ids
    return done
