"""Where a batch's tree nodes come from: a merged suffix method's rounds, sessions generating at once.

Runs N MT-Bench first turns (the bench's `--concurrency N --per-category 2` prompts) continuously
batched in process, greedy, and counts over every round of every session: rounds the suffix candidates
carried alone, rounds that asked the model drafter, the model's and the suffix's nodes in the trees
verified, the draft tokens accepted, and the caps the model drafter's cost policy chose. With the
scheduler's count of target forwards and tokens and each session's rounds, that says whether a batch
lost to dearer forwards or to its slowest session (a closed batch ends with it).
docs/benchmarks.md ("An AVX2-only host") quotes:

    python scripts/diagnostics/batch_round_trace.py eagle-cape-suffix --sessions 4
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from specserve.bench.prompts import load_prompts, per_category
from specserve.core import stopping, suffix_drafter
from specserve.core.protocols import DraftTree
from specserve.core.request import GenerationRequest
from specserve.engine import Engine
from specserve.settings import EngineSettings


def trace(counts: Counter) -> None:
    """Wraps SuffixDrafter.propose and CostPolicy.start_round (every instance) to count their rounds."""
    propose = suffix_drafter.SuffixDrafter.propose
    start_round = stopping.CostPolicy.start_round

    def traced_propose(self: Any, token_ids: Sequence[int], round_seed: int) -> DraftTree:
        asked = self.num_model_calls
        draft = propose(self, token_ids, round_seed)
        model_asked = self.num_model_calls > asked
        counts["rounds"] += 1
        counts["rounds asking the model"] += model_asked
        counts["tree nodes (roots included)"] += draft.tree.num_nodes
        counts["suffix nodes"] += len(draft.suffix_nodes)
        counts["model nodes"] += draft.tree.num_nodes - 1 - len(draft.suffix_nodes)
        return draft

    def traced_start_round(self: Any) -> int:
        cap = start_round(self)
        counts["model rounds its cost policy let draft nothing" if cap == 0 else "model rounds drafting"] += 1
        return cap

    suffix_drafter.SuffixDrafter.propose = traced_propose  # type: ignore[method-assign]
    stopping.CostPolicy.start_round = traced_start_round  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("method", help="a merged suffix method, e.g. eagle-cape-suffix")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    engine = Engine(EngineSettings.from_env())
    counts: Counter = Counter()
    trace(counts)
    prompts = [engine.encode_prompt(p.text) for p in per_category(load_prompts(), 2)[: args.sessions]]
    request = GenerationRequest.build(method=args.method, max_new_tokens=args.max_new_tokens)
    engine.generate_many(prompts[:1], request)  # warm-up
    counts.clear()
    start = time.perf_counter()
    results = engine.generate_many(prompts, request)
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
