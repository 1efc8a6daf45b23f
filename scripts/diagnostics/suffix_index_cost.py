"""What a request's suffix index costs the router to build from its whole prompt (core/suffix.py), by length.

    python scripts/diagnostics/suffix_index_cost.py

The router builds each session's index from the prompt at its first round, cached prefix or not
(docs/prefix-cache.md, "Not kept across requests"). Prints the best of 5 builds and the first round's
proposal, in milliseconds, for random prompts of each length (the index's work does not depend on the
tokens' values, only on how often n-grams repeat, and random tokens rarely repeat: a lower bound for text
that repeats itself).
"""

from __future__ import annotations

import random
import time

from specserve.core.cost import NOMINAL_CPU_COST
from specserve.core.suffix_drafter import SuffixDrafter

LENGTHS = (256, 512, 1024, 1540, 3072)


def main() -> None:
    generator = random.Random(0)
    for length in LENGTHS:
        tokens = [generator.randrange(49152) for _ in range(length)]
        best = float("inf")
        for _ in range(5):
            drafter = SuffixDrafter(None, 64, NOMINAL_CPU_COST)  # a new session's: an empty index
            start = time.perf_counter()
            drafter.propose(tokens, 0, 1)  # indexes the prompt, then proposes
            best = min(best, time.perf_counter() - start)
        print(f"{length:5d} prompt tokens: {best * 1e3:6.2f} ms", flush=True)


if __name__ == "__main__":
    main()
