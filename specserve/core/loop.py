"""The one speculative loop: draft, verify, commit, emit. Every method and every transport runs it."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace

from specserve.core.backoff import DraftBackoff
from specserve.core.finish import FinishChecker
from specserve.core.grammar import GrammarState, forced_draft, shape_draft
from specserve.core.protocols import (
    AheadVerifier,
    Drafter,
    DraftTree,
    PlansAhead,
    RootSeededDrafter,
    RoundOutcome,
    Verifier,
)
from specserve.core.rng import draft_round_seed, verify_round_seed
from specserve.errors import FailedPrecondition
from specserve.results import GenerationStats


def speculative_generate(
    prompt_ids: Sequence[int],
    verifier: Verifier,
    drafter: Drafter | None,
    request_seed: int,
    finish: FinishChecker,
    on_tokens: Callable[[list[int]], None] | None = None,
    generated_ids: Sequence[int] = (),
    round_scope: Callable[[int], AbstractContextManager[object]] | None = None,
    on_round: Callable[[RoundOutcome], None] | None = None,
    batch_sessions: Callable[[], int] | None = None,
    grammar: GrammarState | None = None,
) -> GenerationStats:
    """Generates until `finish` says so; new tokens go to `on_tokens` as soon as they are accepted.

    With drafter None this is plain decoding on the same engine (the `target` baseline). The drafter
    and verifier already hold the session's sampling parameters. Randomness of a round depends only on
    (request_seed, position) (core/rng.py), so a run is reproducible and resumable:
    `generated_ids` are tokens an earlier run already emitted (a resumed session); they are not emitted
    again, and the result is the same as if the run had never stopped. `round_scope(position)`, if
    given, wraps each round (the router opens a tracing span there). Each round's outcome goes to the
    drafter's `observe` (its stop policy and suffix index learn from it) and to `on_round` (metrics),
    before its tokens are emitted. `batch_sessions()`: the sessions whose segments share the target's
    forwards now, this one included, as the caller's scheduler knows them (None: alone); read once per
    round and handed to the drafter, whose cost policy sizes the round's tree by it.

    Under a constraint the verifier masks the target (it holds its own guide); `grammar`, the loop's
    place in the same language, shapes the drafts (core/grammar.py): a round where the language forces
    the continuation drafts it without asking the drafter, and a drafter's tree loses what the language
    forbids. The drafter then observes its round as it proposed it.
    """
    stats = GenerationStats()
    start = time.perf_counter()
    token_ids = list(prompt_ids)

    def emit(new_tokens: list[int]) -> None:
        kept = finish.extend(new_tokens)
        token_ids.extend(kept)
        stats.num_generated_tokens += len(kept)
        if kept and on_tokens is not None:
            on_tokens(kept)

    t0 = time.perf_counter()
    if generated_ids:
        token_ids.extend(finish.extend(list(generated_ids)))
        verifier.resume(token_ids)
    else:
        first = verifier.prefill(prompt_ids, verify_round_seed(request_seed, len(token_ids)))
        stats.num_target_forwards += 1
        emit([first])
    stats.verify_s += time.perf_counter() - t0

    # Rounds may run where the target is when both sides can (decided once: the checks walk protocols).
    ahead = verifier if isinstance(verifier, AheadVerifier) and grammar is None else None
    planner = drafter if isinstance(drafter, PlansAhead) else None
    root_candidates: tuple[int, ...] = ()  # the target's candidates after a target-rooted round
    backoff = DraftBackoff()  # skips a drafter that keeps proposing nothing (under load)
    while not finish.done:
        position = len(token_ids)
        with round_scope(position) if round_scope is not None else nullcontext():
            t0 = time.perf_counter()
            draft_seed = draft_round_seed(request_seed, position)
            sessions = max(1, batch_sessions()) if batch_sessions is not None else 1
            forced = None
            if grammar is not None:
                grammar.sync(token_ids)
                # Forced rounds are drafting: the `target` baseline (no drafter) decodes one token a round.
                forced = forced_draft(token_ids[-1], grammar) if drafter is not None else None
            if forced is not None:
                draft = forced
            elif drafter is None:
                draft = DraftTree.root_only(token_ids[-1])
            elif root_candidates:
                if not isinstance(drafter, RootSeededDrafter):
                    raise FailedPrecondition("root candidates came back to a drafter that cannot use them")
                draft = drafter.propose_from_roots(token_ids, root_candidates, draft_seed, sessions)
            elif backoff.should_ask():
                draft = drafter.propose(token_ids, draft_seed, sessions)
                if not draft.target_roots:
                    backoff.observe(draft.num_draft_tokens)
            else:
                draft = DraftTree.root_only(token_ids[-1])
            proposed = draft  # what the drafter (or the forced chain) proposed, before shaping
            if grammar is not None and forced is None and drafter is not None:
                draft = shape_draft(draft, grammar)
            t1 = time.perf_counter()
            seed = verify_round_seed(request_seed, position)
            if ahead is not None and planner is not None and ahead.ahead_limit > 0 and not draft.target_roots:
                # The rounds after this one that would ask no draft model run where the target is, as
                # this loop would run them: those it skips its drafter for (the root alone), and those
                # the drafter would not ask its model for. The loop follows those that ran (the
                # verifier may stop early: time, room, the end).
                own = planner.rounds_without_model(ahead.ahead_limit)
                # with the suffix account as it stands: the rounds there are sized as they are here
                plan = replace(
                    own, skip_run=backoff.run, skip_left=backoff.left, suffix=planner.suffix_trust()
                )
                rounds = ahead.verify_ahead(draft, seed, plan, finish.tokens_left)
                asked = sum(backoff.follow(ran.num_draft_tokens) for ran, _ in rounds[1:])
                planner.skip_rounds(min(asked, own.rounds))
                account = ahead.take_suffix_trust()
            else:
                rounds = [(draft, verifier.verify(draft, seed))]
                account = None
            t2 = time.perf_counter()
            stats.draft_s += t1 - t0
            stats.verify_s += t2 - t1
            for i, (verified_draft, verified) in enumerate(rounds):
                # the one account of the round, for every reader
                outcome = RoundOutcome.of(verified_draft, verified)
                stats.num_target_forwards += 1
                stats.num_ahead_rounds += i > 0
                stats.num_draft_tokens += verified_draft.num_draft_tokens
                stats.num_accepted_tokens += outcome.num_accepted_tokens
                stats.num_suffix_draft_tokens += outcome.num_suffix_draft_tokens
                stats.num_suffix_accepted_tokens += outcome.num_suffix_accepted_tokens
                stats.num_forced_draft_tokens += outcome.num_forced_draft_tokens
                stats.num_forced_accepted_tokens += outcome.num_forced_accepted_tokens
                if drafter is not None:
                    # A round the verifier ran on its own reaches the drafter as it was verified.
                    shaped = i == 0 and (forced is not None or proposed is not draft)
                    drafter.observe(_as_proposed(proposed, outcome, forced) if shaped else outcome)
                if on_round is not None:
                    on_round(outcome)
                root_candidates = verified.root_candidates
                emit(outcome.emitted_token_ids)
                if finish.done:
                    break
            if account is not None and planner is not None:
                # after the rounds are observed (the first updates this drafter as it did the verifier's)
                planner.adopt_trust(account)

    stats.elapsed_s = time.perf_counter() - start
    return stats


def _as_proposed(proposed: DraftTree, outcome: RoundOutcome, forced: DraftTree | None) -> RoundOutcome:
    """The round as its drafter proposed it, before a constraint shaped it: walked along the tokens it
    committed. A forced round asked no drafter: it sees a root-only round, as when it is skipped."""
    drafted = DraftTree.root_only(proposed.tree.token_ids[0]) if forced is not None else proposed
    return RoundOutcome.from_committed(drafted, outcome.emitted_token_ids)
