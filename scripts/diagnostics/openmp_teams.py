"""A target's forwards with one OpenMP team in the process, then after a second thread has run torch.

The model loads as the runtime loads it (weights as SPECSERVE_WEIGHTS says: the file's own on a CPU) on a
model thread the main thread never competes with; a one-token step and a 7-node tree verify are timed
there; then the main thread runs a few forwards of its own (a second team of OpenMP workers now lives in
the process) and the model thread is timed again. docs/benchmarks.md (the distributed stack) quotes it:

    python scripts/diagnostics/openmp_teams.py
"""

from __future__ import annotations

import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ab_step  # the runtime's loading

from specserve.runtime.kv_cache import PositionalKVCache
from specserve.runtime.runner import ModelRunner

PARENTS = [-1, 0, 0, 0, 1, 1, 4]  # a 7-node tree, like a CaPE round
PREFIX = 150
REPEATS = 60


def build() -> tuple[ModelRunner, PositionalKVCache, list[int]]:
    runner = ab_step.load_runner("specserve")[0]
    assert isinstance(runner, ModelRunner)
    generator = torch.Generator().manual_seed(0)
    cache = runner.new_cache(PREFIX + 64)
    runner.forward(cache, torch.randint(0, runner.vocab_size, (PREFIX,), generator=generator).tolist())
    tokens = torch.randint(0, runner.vocab_size, (len(PARENTS),), generator=generator).tolist()
    return runner, cache, tokens


def medians_ms(
    runner: ModelRunner, cache: PositionalKVCache, tokens: list[int], repeats: int
) -> tuple[float, float]:
    """The median one-token step and 7-node verify, taken in turn."""
    one: list[float] = []
    tree: list[float] = []
    with torch.inference_mode():
        for i in range(repeats + 1):
            for times, ids, parents in ((one, tokens[:1], None), (tree, tokens, PARENTS)):
                start = time.perf_counter()
                runner.forward(cache, ids, parents)
                cache.truncate(PREFIX)
                if i:  # the first of each warms up
                    times.append(time.perf_counter() - start)
    return statistics.median(one) * 1e3, statistics.median(tree) * 1e3


def main() -> None:
    model_thread = ThreadPoolExecutor(max_workers=1)
    runner, cache, tokens = model_thread.submit(build).result()  # the main thread never ran torch
    step, verify = model_thread.submit(medians_ms, runner, cache, tokens, REPEATS).result()
    print(
        f"one team (only the model thread ran torch): {step:.2f} ms a step, {verify:.2f} ms a 7-node verify"
    )
    medians_ms(runner, cache, tokens, repeats=2)  # the main thread runs torch: a second team exists
    step, verify = model_thread.submit(medians_ms, runner, cache, tokens, REPEATS).result()
    print(
        f"two teams (the main thread ran torch too):  {step:.2f} ms a step, {verify:.2f} ms a 7-node verify"
    )


if __name__ == "__main__":
    main()
