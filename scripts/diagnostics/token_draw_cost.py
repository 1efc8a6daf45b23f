"""What drawing tokens from a distribution over a vocabulary costs on one CPU core: torch.multinomial
(one sample; four without and with replacement) against core/sampling's `sample_token` and
`sample_without_replacement`, for the default model's 49,152 tokens and Qwen2.5's 151,936. The median of
many calls each, on a softmax of random logits. docs/benchmarks.md (sampling at T > 0) quotes:

    python scripts/diagnostics/token_draw_cost.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from specserve.core.sampling import sample_token, sample_without_replacement

VOCABULARIES = (49152, 151936)
CALLS = 200
CANDIDATES = 4


def median_ms(fn: Callable[[], object]) -> float:
    times = []
    for _ in range(CALLS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def draws(q: torch.Tensor, g: torch.Generator) -> dict[str, Callable[[], object]]:
    """Each way of drawing from q [V], as a call to time."""
    return {
        "torch.multinomial, 1": lambda: torch.multinomial(q, 1, generator=g),
        "sample_token": lambda: sample_token(q, g),
        f"torch.multinomial, {CANDIDATES} without replacement": lambda: torch.multinomial(
            q, CANDIDATES, replacement=False, generator=g
        ),
        f"sample_without_replacement, {CANDIDATES}": lambda: sample_without_replacement(q, CANDIDATES, g),
        f"torch.multinomial, {CANDIDATES} with replacement": lambda: torch.multinomial(
            q, CANDIDATES, replacement=True, generator=g
        ),
    }


def main() -> None:
    torch.set_num_threads(1)
    for vocab in VOCABULARIES:
        q = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 3, -1)
        for name, fn in draws(q, torch.Generator().manual_seed(1)).items():
            print(f"{vocab} tokens: {name}: {median_ms(fn):.3f} ms")


if __name__ == "__main__":
    main()
