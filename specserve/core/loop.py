"""The one speculative loop: draft, verify, commit, emit. Every method and every transport runs it."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from specserve.core.finish import FinishChecker
from specserve.core.protocols import Drafter, DraftTree, Verifier
from specserve.core.rng import Stream, round_seed
from specserve.core.sampling_params import SamplingParams
from specserve.results import GenerationStats


def speculative_generate(
    prompt_ids: Sequence[int],
    verifier: Verifier,
    drafter: Drafter | None,
    params: SamplingParams,
    seed: int,
    finish: FinishChecker,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> GenerationStats:
    """Generates until `finish` says so; new tokens go to `on_tokens` as soon as they are accepted.

    With drafter None this is plain decoding on the same engine (the `target` baseline).
    Randomness of a round depends only on (seed, position), so a run is reproducible and resumable.
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
    first = verifier.prefill(prompt_ids, params, round_seed(seed, len(token_ids), Stream.VERIFY))
    stats.verify_s += time.perf_counter() - t0
    stats.num_target_forwards += 1
    emit([first])

    while not finish.done:
        position = len(token_ids)
        t0 = time.perf_counter()
        if drafter is None:
            draft = DraftTree.root_only(token_ids[-1])
        else:
            draft = drafter.propose(token_ids, params, round_seed(seed, position, Stream.DRAFT))
        t1 = time.perf_counter()
        outcome = verifier.verify(draft, params, round_seed(seed, position, Stream.VERIFY))
        t2 = time.perf_counter()
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        stats.num_target_forwards += 1
        stats.num_draft_tokens += draft.num_draft_tokens
        stats.num_accepted_tokens += len(outcome.accepted_nodes) - 1
        accepted = [draft.tree.token_ids[i] for i in outcome.accepted_nodes[1:]]
        emit([*accepted, outcome.next_token])

    stats.elapsed_s = time.perf_counter() - start
    return stats
