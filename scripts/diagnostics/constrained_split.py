"""Where the constrained `target` and the default method spend a json-extraction run: each request's wall
time, its Verify calls (the rounds after the prompt's first token) and the target forwards inside them,
and the median forward by tree size.

Every prompt runs under its schema with each method in turn, each from an empty prefix cache (as
`specserve bench` runs them), in one process on the default model. What is neither a round nor drafting
is the prompt's prefill and first token. docs/benchmarks.md (structured output) quotes:

    python scripts/diagnostics/constrained_split.py
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import specserve.runtime.runner as runner_module
import specserve.runtime.target as target_module
from specserve.bench.prompts import load_prompts
from specserve.bench.runner import forget_prompts
from specserve.catalog import DEFAULT_METHOD
from specserve.core.request import GenerationRequest
from specserve.engine import Engine

METHODS = ("target", DEFAULT_METHOD)


def main() -> None:
    engine = Engine()
    seconds: dict[tuple[str, str], float] = defaultdict(float)
    rounds: dict[str, int] = defaultdict(int)
    by_size: dict[tuple[str, int], list[float]] = defaultdict(list)
    state: dict[str, Any] = {"method": "", "in_verify": False}
    verify, forward = target_module.LocalVerifier.verify, runner_module.ModelRunner.forward

    def timed_forward(self: Any, cache: Any, ids: Sequence[int], *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = forward(self, cache, ids, *args, **kwargs)
        if state["in_verify"]:
            spent = time.perf_counter() - start
            seconds[(state["method"], "forwards")] += spent
            by_size[(state["method"], len(ids))].append(spent)
        return out

    def timed_verify(self: Any, draft: Any, round_seed: int) -> Any:
        state["in_verify"] = True
        start = time.perf_counter()
        try:
            return verify(self, draft, round_seed)
        finally:
            state["in_verify"] = False
            seconds[(state["method"], "rounds")] += time.perf_counter() - start
            rounds[state["method"]] += 1

    target_module.LocalVerifier.verify = timed_verify  # type: ignore[method-assign]
    runner_module.ModelRunner.forward = timed_forward  # type: ignore[method-assign]
    prompts = load_prompts("json-extraction")
    request = GenerationRequest.build(max_new_tokens=256)
    for method in METHODS:  # warm-up, untimed
        engine.generate(prompts[0].text, replace(request, method=method, constraint=prompts[0].constraint))
    for table in (seconds, rounds, by_size):
        table.clear()
    for prompt in prompts:
        for method in METHODS:
            forget_prompts(engine)
            state["method"] = method
            start = time.perf_counter()
            engine.generate(prompt.text, replace(request, method=method, constraint=prompt.constraint))
            seconds[(method, "wall")] += time.perf_counter() - start
    for method in METHODS:
        wall, spent, inside = (seconds[(method, part)] for part in ("wall", "rounds", "forwards"))
        print(
            f"{method}: {wall:.3f} s, {rounds[method]} rounds {spent:.3f} s (forwards {inside:.3f} s), "
            f"the rest (prefill, first token, drafting) {wall - spent:.3f} s"
        )
    print("median forward of a round, by tree size (rounds of that size):")
    for (method, size), values in sorted(by_size.items()):
        if len(values) >= 5:
            print(f"  {method} {size:2d} nodes: {statistics.median(values) * 1e3:.2f} ms ({len(values)})")


if __name__ == "__main__":
    main()
