"""What the cost policy decides, round by round, for one method on MT-Bench first turns.

Generates in process (greedy, 128 tokens) with the method's real drafter and counts, over all rounds:
the caps `start_round` chose (0 = the round drafts nothing), the spine tokens drafted and accepted per
round, and the policy's acceptance estimate at the end, with the predicted acceptance of each round's
first spine token. docs/benchmarks.md ("The cost policy's estimate ages") quotes:

    python scripts/diagnostics/cost_policy_trace.py glide-cape-cost --prompts 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from typing import Any

import torch

from specserve.bench.prompts import load_prompts, per_category
from specserve.core import stopping
from specserve.core.request import GenerationRequest
from specserve.engine import Engine
from specserve.settings import EngineSettings


def trace(policy_class: Any, counts: Counter, first_estimates: list[float]) -> None:
    """Wraps the policy's methods to count what they decide (every instance: one per request)."""
    start_round, choose_width, observe = (
        policy_class.start_round,
        policy_class.choose_width,
        policy_class.observe,
    )

    def traced_start_round(self: Any, batch_sessions: int) -> int:
        cap = start_round(self, batch_sessions)
        counts["rounds drafting nothing" if cap == 0 else "rounds allowed to draft"] += 1
        return cap

    def traced_choose_width(self: Any, depth_index: int, logits: torch.Tensor, width: int) -> int:
        kept = choose_width(self, depth_index, logits, width)
        if depth_index == 0:
            first_estimates.append(self.last_acceptance)
        return kept

    def traced_observe(self: Any, num_drafted: int, num_accepted: int) -> None:
        observe(self, num_drafted, num_accepted)
        if num_drafted:
            counts["spine tokens drafted"] += num_drafted
            counts["spine tokens accepted"] += num_accepted
        counts["estimate at the last round (x1000)"] = round(1000 * self.mean_acceptance)

    policy_class.start_round = traced_start_round
    policy_class.choose_width = traced_choose_width
    policy_class.observe = traced_observe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("method", help="a method with the cost policy, e.g. glide-cape-cost")
    parser.add_argument("--prompts", type=int, default=3, help="MT-Bench first turns, one per category")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    engine = Engine(EngineSettings.from_env())
    counts: Counter = Counter()
    first_estimates: list[float] = []
    trace(stopping.CostPolicy, counts, first_estimates)
    for prompt in per_category(load_prompts(), 1)[: args.prompts]:
        start = time.perf_counter()
        request = GenerationRequest.build(method=args.method, max_new_tokens=args.max_new_tokens)
        result = engine.generate(prompt.text, request)
        rate = len(result.token_ids) / (time.perf_counter() - start)
        print(f"{prompt.category}: {len(result.token_ids)} tokens, {rate:.1f} tok/s")
    for name, value in counts.items():
        print(f"{name}: {value}")
    if first_estimates:
        print(f"predicted acceptance of a round's first token: mean {statistics.mean(first_estimates):.3f}")


if __name__ == "__main__":
    main()
