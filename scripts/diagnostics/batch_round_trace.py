"""Where a batch's tree nodes come from: a merged suffix method's rounds, sessions generating at once.

Runs N MT-Bench first turns (the bench's `--concurrency N --per-category 2` prompts) continuously
batched in process, greedy, and counts over every round of every session, from the loop's round
outcomes: rounds the suffix candidates carried alone, rounds with the model drafter's nodes, the
model's and the suffix's nodes in the trees verified and the draft tokens accepted. With the
scheduler's count of target forwards and tokens and each session's rounds, that says whether a batch
lost to dearer forwards or to its slowest session (a closed batch ends with it).
docs/benchmarks.md ("An AVX2-only host") quotes:

    python scripts/diagnostics/batch_round_trace.py eagle-cape-suffix --sessions 4
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Callable

from specserve.bench.prompts import load_prompts, per_category
from specserve.core.protocols import RoundOutcome
from specserve.core.request import GenerationRequest
from specserve.engine import Engine
from specserve.settings import EngineSettings


def counter(counts: Counter) -> Callable[[RoundOutcome], None]:
    """The loop's `on_round`: adds each round's trees and tokens to `counts`."""

    def count(outcome: RoundOutcome) -> None:
        tree = outcome.draft.tree
        suffix = outcome.num_suffix_draft_tokens
        model = tree.num_nodes - 1 - suffix
        counts["rounds"] += 1
        counts["rounds with model nodes"] += model > 0
        counts["rounds of suffix candidates alone"] += model == 0 and suffix > 0
        counts["rounds of the root alone"] += tree.num_nodes == 1
        counts["tree nodes (roots included)"] += tree.num_nodes
        counts["suffix nodes"] += suffix
        counts["model nodes"] += model

    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("method", help="a merged suffix method, e.g. eagle-cape-suffix")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    engine = Engine(EngineSettings.from_env())
    counts: Counter = Counter()
    prompts = [engine.encode_prompt(p.text) for p in per_category(load_prompts(), 2)[: args.sessions]]
    request = GenerationRequest.build(method=args.method, max_new_tokens=args.max_new_tokens)
    engine.generate_many(prompts[:1], request)  # warm-up
    start = time.perf_counter()
    results = engine.generate_many(prompts, request, on_round=counter(counts))
    wall = time.perf_counter() - start
    stats = engine.last_batch_stats
    forwards, tokens = stats.per_model.get("target", (0, 0))
    generated = sum(len(r.token_ids) for r in results)
    print(f"{args.method}, {args.sessions} sessions: {generated} tokens in {wall:.2f} s")
    print(f"target forwards {forwards}, tokens per forward {tokens / max(1, forwards):.1f}")
    print("seconds inside forwards:", {k: round(v, 2) for k, v in stats.seconds_per_model.items()})
    # A closed batch ends with its slowest session: the forwards after the others finished serve it alone.
    print("rounds per session:", [r.stats.num_target_forwards for r in results])
    print("draft tokens accepted:", sum(r.stats.num_accepted_tokens for r in results))
    print("suffix tokens accepted:", sum(r.stats.num_suffix_accepted_tokens for r in results))
    for name, value in counts.items():
        print(f"{name}: {value}")


if __name__ == "__main__":
    main()
