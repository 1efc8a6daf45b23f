"""What a request's suffix index costs the router (core/suffix.py), built from the whole prompt or started
from the tenant's earlier prompt over the same document (core/prompt_indexes.py), by length.

    python scripts/diagnostics/suffix_index_cost.py

Each prompt is a document of the given length and a 32-token question; the cached case has seen the
same document under another question. Prints, in milliseconds, the best of 5 first rounds (indexing the
prompt, then proposing) of a new session, built alone and from the cache, and one later round's proposal
in each (reading the shared spans adds dictionary lookups per round). Random tokens: the index's work
does not depend on the tokens' values, only on how often n-grams repeat, and random tokens rarely
repeat (a lower bound for text that repeats itself).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

from specserve.core.cost import NOMINAL_CPU_COST
from specserve.core.prompt_indexes import PROMPT_INDEX_TOKENS, PromptIndexCache, TenantPrompts
from specserve.core.suffix_drafter import SuffixDrafter

LENGTHS = (256, 512, 1024, 1540, 3072)
QUESTION_TOKENS = 32
VOCAB = 49152
T = TypeVar("T")


def best_ms(run: Callable[[T], object], setup: Callable[[], T], repeats: int = 5) -> float:
    """The best time of `run(setup())`, setup untimed."""
    best = float("inf")
    for _ in range(repeats):
        arg = setup()
        start = time.perf_counter()
        run(arg)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def first_round(prompt: list[int], prompts: TenantPrompts | None) -> SuffixDrafter:
    """A new session's: indexes the prompt (from `prompts` if given), then proposes."""
    drafter = SuffixDrafter(None, 64, NOMINAL_CPU_COST, prompts=prompts)
    drafter.propose(prompt, 0, 1)
    return drafter


def seen(earlier: list[int]) -> TenantPrompts:
    """A cache that has indexed `earlier` for the tenant."""
    prompts = TenantPrompts(PromptIndexCache(PROMPT_INDEX_TOKENS), "tenant")
    first_round(earlier, prompts)
    return prompts


def measure(document: list[int], generator: random.Random) -> tuple[float, float, float, float]:
    """(first round alone, from the cache, a later round alone, from the cache), in ms."""
    earlier, prompt = (
        document + [generator.randrange(VOCAB) for _ in range(QUESTION_TOKENS)] for _ in range(2)
    )
    alone_ms = best_ms(lambda _: first_round(prompt, None), lambda: None)
    cached_ms = best_ms(lambda prompts: first_round(prompt, prompts), lambda: seen(earlier))
    alone, cached = first_round(prompt, None), first_round(prompt, seen(earlier))
    later = [*prompt, 5]

    def later_round(drafter: SuffixDrafter) -> None:
        drafter.propose(later, 1, 1)

    alone_later = best_ms(later_round, lambda: alone, 50)
    cached_later = best_ms(later_round, lambda: cached, 50)
    return alone_ms, cached_ms, alone_later, cached_later


def main() -> None:
    generator = random.Random(0)
    print("document tokens | first round alone | from the cache | a later round alone | from the cache")
    for length in LENGTHS:
        document = [generator.randrange(VOCAB) for _ in range(length)]
        alone, cached, alone_later, cached_later = measure(document, generator)
        print(
            f"{length:15d} | {alone:17.2f} | {cached:14.2f} | {alone_later:19.3f} | {cached_later:14.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
