"""Verify-cost curves measured size by size against round-robin, alternating, on one loaded model.

Each run measures the same tree sizes twice, once each way (`runtime/calibrate.py`): size by size (one
warm-up, then the fastest of 3 calls of that size before the next size) and round-robin (a warm-up pass,
then 3 passes over every size). Prints each curve in one-token steps, so the spread of a method across
runs shows how far the host's drift moves it. docs/benchmarks.md ("Calibration on a drifting host")
quotes:

    python scripts/diagnostics/calibration_drift.py --model qwen2.5-coder-1.5b-instruct --runs 3
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from specserve.models import load_causal_lm, resolve_model_dir
from specserve.runtime.calibrate import best_of, interleaved_best, tree_verify_calls
from specserve.runtime.runner import ModelRunner
from specserve.settings import EngineSettings

SIZES = (1, 2, 4, 8, 16, 32, 64)
REPEATS = 3


def in_steps(seconds: Sequence[float]) -> str:
    return f"step {seconds[0] * 1e3:6.1f} ms | " + " ".join(f"{s / seconds[0]:5.2f}" for s in seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model profile (default: the default model)")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    settings = EngineSettings.from_env(model=args.model)
    if settings.num_threads > 0:
        torch.set_num_threads(settings.num_threads)
    model_dir = resolve_model_dir(settings.model_dir, settings.cache_dir, settings.model)
    runner = ModelRunner(load_causal_lm(model_dir, linear_kernel="auto"))
    print(f"{'':24s} one-token step | verify(n) in steps for n = {', '.join(map(str, SIZES))}")
    with torch.inference_mode():
        calls = tree_verify_calls(runner, SIZES)
        for run in range(1, args.runs + 1):
            by_size = [best_of(call, REPEATS) for call in calls]
            print(f"run {run} size by size      {in_steps(by_size)}", flush=True)
            round_robin = interleaved_best(calls, REPEATS)
            print(f"run {run} round-robin       {in_steps(round_robin)}", flush=True)


if __name__ == "__main__":
    main()
