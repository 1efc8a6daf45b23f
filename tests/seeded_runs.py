"""Many seeded runs of one speculative session, for the sampling statistics: the runs go in waves of
sessions that share every forward (runtime/batching.py, as the engine's and the target service's
batches do), so a chi-square over thousands of seeds costs a fraction of running them one by one, and
the distribution is checked where sessions are batched. A few seeds also run alone and must give the
same result: a seeded session's output does not depend on what shares its forwards."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from specserve.runtime.batching import Scheduler

T = TypeVar("T")

WAVE = 500  # sessions at once: the tiny models' forwards stay small, the Python per session dominates
ALONE = 4  # seeds run alone too, compared with their batched runs
TOKENS_PER_FORWARD = 1 << 20  # never the bound: every session of a wave joins each step


def seeded_runs(run: Callable[[int], T], trials: int, wave: int = WAVE, alone: int = ALONE) -> list[T]:
    """run(seed) for seeds 0..trials-1, batched `wave` at a time; results in seed order."""
    results: list[T] = []
    for first in range(0, trials, wave):
        jobs = [(lambda seed=seed: run(seed)) for seed in range(first, min(first + wave, trials))]
        results += Scheduler(TOKENS_PER_FORWARD).run_all(jobs, thread_context=torch.inference_mode())
    for seed in range(min(alone, trials)):
        with torch.inference_mode():
            assert run(seed) == results[seed], f"seed {seed}: batched and alone differ"
    return results
