"""What a one-token forward costs right after a larger one, step by step, and what the calibration reads.

On a host where the model's weights fit in the last-level cache (an Intel Xeon's 260 MB), a larger forward
leaves the next small ones slow for many steps. This prints, for each larger size, the one-token steps that
follow one forward of it (a bushy tree after `--prefix` cached positions, as `specserve calibrate` times),
then the verify curve timed both ways in one process: each pass going up from one token (the calibration
before `time_by_size`), and each pass from the largest down with each size after its own untimed call
(`runtime/calibrate.py`, `time_by_size`). The model and weights are the configured ones (SPECSERVE_MODEL,
SPECSERVE_WEIGHTS). docs/benchmarks.md ("An Intel Xeon host") quotes:

    python scripts/diagnostics/step_after_larger.py
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ab_step  # the runtime's loading

from specserve.runtime import calibrate

SHOWN = (1, 2, 4, 8, 16, 32, 64)  # sizes of the curves printed, in one-token steps


def in_steps(sizes: Sequence[int], seconds: Sequence[float]) -> str:
    by_size = dict(zip(sizes, seconds, strict=True))
    step = by_size[1]
    return f"step {step * 1e3:5.2f} ms | " + " ".join(f"{n}: {by_size[n] / step:.2f}" for n in SHOWN)


def timed(call: Callable[[], None]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", type=int, default=calibrate.PROMPT_TOKENS, help="cached positions first")
    parser.add_argument("--after", default="64,16,8,1", help="the larger sizes each sequence follows")
    parser.add_argument("--steps", type=int, default=15, help="one-token steps timed after each")
    parser.add_argument("--runs", type=int, default=2, help="curves timed each way, alternating")
    args = parser.parse_args()
    runner, _ = ab_step.load_runner("specserve")
    sizes = list(calibrate.VERIFY_SIZES)
    with torch.inference_mode():
        calls = dict(zip(sizes, calibrate.tree_verify_calls(runner, sizes, args.prefix), strict=True))
        for call in calls.values():
            call()  # warm-up
        print(f"one-token steps (ms) after one forward of n tokens, {args.prefix} positions cached:")
        for larger in map(int, args.after.split(",")):
            for _ in range(2):
                calls[larger]()
                steps = [timed(calls[1]) * 1e3 for _ in range(args.steps)]
                print(f"  n = {larger:3d}: " + " ".join(f"{ms:.2f}" for ms in steps), flush=True)
        print("verify(n) in one-token steps:")
        for run in range(1, args.runs + 1):
            going_up = calibrate.interleaved_best(list(calls.values()), 3)
            print(f"  run {run}, going up:        {in_steps(sizes, going_up)}", flush=True)
            settled = calibrate.time_by_size(sizes, list(calls.values()), 3, "timing")
            largest_first = [seconds for _, seconds in settled]
            print(
                f"  run {run}, largest first, each size settled: {in_steps(sizes, largest_first)}", flush=True
            )


if __name__ == "__main__":
    main()
