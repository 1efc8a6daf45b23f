"""A tree verify with one OpenMP team in the process, then after a second thread has run torch.

docs/benchmarks.md (the distributed stack) quotes it:
`python scripts/diagnostics/openmp_teams.py` on the default model.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from specserve.models import default_model_dir, load_causal_lm
from specserve.runtime.runner import ModelRunner
from specserve.settings import EngineSettings

PARENTS = [-1, 0, 0, 0, 1, 1, 4]  # a 7-node tree, like a CaPE round
PREFIX = 150


def build() -> tuple[ModelRunner, object, list[int]]:
    import torch

    runner = ModelRunner(load_causal_lm(default_model_dir(EngineSettings.from_env().cache_dir)))
    generator = torch.Generator().manual_seed(0)
    cache = runner.new_cache(PREFIX + 64)
    runner.forward(cache, torch.randint(0, runner.vocab_size, (PREFIX,), generator=generator).tolist())
    tokens = torch.randint(0, runner.vocab_size, (len(PARENTS),), generator=generator).tolist()
    return runner, cache, tokens


def median_ms(runner: ModelRunner, cache, tokens: list[int], repeats: int = 30) -> float:
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        runner.forward(cache, tokens, PARENTS)
        cache.truncate(PREFIX)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def main() -> None:
    model_thread = ThreadPoolExecutor(max_workers=1)
    runner, cache, tokens = model_thread.submit(build).result()  # the main thread never ran torch
    one = model_thread.submit(median_ms, runner, cache, tokens).result()
    print(f"one team (only the model thread ran torch): {one:.1f} ms per 7-node verify")
    median_ms(runner, cache, tokens, repeats=2)  # the main thread runs torch: a second team exists
    two = model_thread.submit(median_ms, runner, cache, tokens).result()
    print(f"two teams (the main thread ran torch too):  {two:.1f} ms per 7-node verify")


if __name__ == "__main__":
    main()
