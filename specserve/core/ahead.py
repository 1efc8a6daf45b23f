"""Rounds a target runs on its own after the round it was sent: the loop beside the target.

Through the stack every round is a Verify call, and a call costs a few milliseconds of network,
(de)serialization and hand-offs between threads on both sides: for a small model as much as half a
round. A round that asks no draft model (suffix candidates only, core/suffix_drafter.py) needs
nothing the target does not hold: its candidates come from the session's own text. So the router asks
the target to run such rounds after the one it sends (`AheadVerifier`, VerifyRequest.ahead_rounds),
and they cost a forward each and no call.

The rounds are the ones the router's loop would run, tree by tree: where the loop skips a drafter that
proposed nothing (core/backoff.py), the round verifies the root alone here too. Drafting those rounds
instead (whatever a one-token match offered) made the target's trees larger than the loop's, for fewer
rounds but more nodes and no more tokens: one session through the stack ran 0.73-0.81x in process that
way, 0.80-0.85x this way (docs/benchmarks.md, "Rounds beside the target").

Greedy, unconstrained sessions only: greedy output is the target's whatever is drafted, so running a
round here or there changes how fast the text comes, never the text. (A sampled session's tree decides
its draws, and a constrained session's drafts are shaped by a guide the router keeps.) The drafter is
the session's own on the target, over its own tokens: no other session's text reaches it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from specserve.core.backoff import DraftBackoff
from specserve.core.protocols import AheadPlan, Drafter, DraftTree, PlansAhead, RoundOutcome, VerifyOutcome

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
    """`first` (a round already verified), then the rounds `plan` allows, as the caller's loop would run
    them: a round its DraftBackoff (as `plan` gives it) skips verifies the root alone; any other is
    drafted by `drafter` from `token_ids()` (the session's committed tokens, the root last): the first
    `rounds` of those whatever they draft, then while `expected_tokens()` (what the drafter's last
    proposal expects to be accepted) is at least `copy_tokens`; the first that falls short is left to
    the caller's loop, unverified. Each is verified by `verify`. They stop after `plan.total` rounds,
    once `max_tokens` tokens are committed (first's included), after a round that commits one of
    `stop_token_ids`, where `admit` finds no room for a round's tree, or at `deadline` on `clock` (no
    round starts after it: the caller's stream waits for these rounds). The drafter observes each round
    it proposed. Where the plan carries the caller's suffix account (`plan.suffix`), the drafter continues
    from it and observes `first` as the caller's drafter proposed it, so one account sizes every round
    as in the caller's loop; the drafter's `suffix_trust()` is that account afterwards."""
    if plan.suffix is not None and isinstance(drafter, PlansAhead):
        drafter.adopt_trust(plan.suffix)
        first_draft, first_verified = first
        proposed = replace(first_draft, suffix_nodes=plan.suffix.suffix_nodes)  # the wire's tree has none
        drafter.observe(RoundOutcome.of(proposed, first_verified))
    done = [first]
    made = committed_tokens(*first)
    backoff = DraftBackoff(run=plan.skip_run, left=plan.skip_left)
    asked = 0  # rounds the drafter proposed
    while (
        len(done) <= plan.total
        and len(made) < max_tokens
        and not stop_token_ids.intersection(made)
        and clock() < deadline
    ):
        proposes = backoff.left == 0
        if proposes:
            draft = drafter.propose(token_ids(), 0, batch_sessions())  # greedy: no seed is read
            if asked >= plan.rounds and expected_tokens() < plan.copy_tokens:
                break  # a round whose drafter would ask its model: the caller's
        else:
            draft = DraftTree.root_only(token_ids()[-1])  # what the loop sends in a skipped round
        if not admit(draft):
            break
        backoff.follow(draft.num_draft_tokens)  # a skipped round is used up, a proposal observed
        asked += proposes
        verified = verify(draft)
        outcome = RoundOutcome.of(draft, verified)
        if proposes:
            drafter.observe(outcome)
        done.append((draft, verified))
        made += outcome.emitted_token_ids
    return done
