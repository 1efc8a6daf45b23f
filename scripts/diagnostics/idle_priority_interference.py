"""Whether work at idle CPU priority slows the work beside it: the whole suite runs its compute tier
beside the integration tier at SCHED_IDLE (scripts/test.sh). Times three kinds of foreground work, on
every core, alone and then beside one idle-priority busy loop per core, alternating, and prints the
best of each: a compute-bound matrix product, a memory-bound pass over 64 MB, and short parallel
regions with a millisecond's sleep between them (a service's forwards between its calls). Linux only.
docs/benchmarks.md ("An AVX2-only host", the test suite) quotes:

    python scripts/diagnostics/idle_priority_interference.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

KINDS = ("matrix products", "64 MB passes", "regions with sleeps")
BUSY_LOOP = "while True: pass"


def foreground() -> tuple[float, float, float]:
    """Seconds of each kind of work, best of three."""
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    big = torch.randn(16 * 1024 * 1024)  # 64 MB of float32

    def once() -> tuple[float, float, float]:
        t0 = time.perf_counter()
        for _ in range(200):
            a @ b
        t1 = time.perf_counter()
        for _ in range(20):
            big.sum()
        t2 = time.perf_counter()
        for _ in range(300):
            a @ b
            time.sleep(0.001)
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    once()  # warm-up
    runs = [once() for _ in range(3)]
    return tuple(min(run[i] for run in runs) for i in range(3))  # type: ignore[return-value]


def idle_busy_loops() -> list[subprocess.Popen[bytes]]:
    cores = os.cpu_count() or 1
    return [subprocess.Popen(["chrt", "--idle", "0", sys.executable, "-c", BUSY_LOOP]) for _ in range(cores)]


def main() -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    results: dict[str, list[tuple[float, float, float]]] = {"alone": [], "beside idle loops": []}
    for _ in range(3):
        results["alone"].append(foreground())
        loops = idle_busy_loops()
        try:
            time.sleep(0.5)
            results["beside idle loops"].append(foreground())
        finally:
            for loop in loops:
                loop.kill()
                loop.wait()
    print("seconds, best of each arm's runs:", ", ".join(KINDS))
    for arm, runs in results.items():
        best = [min(run[i] for run in runs) for i in range(3)]
        print(f"{arm:>18}: " + "  ".join(f"{x:.3f}" for x in best))


if __name__ == "__main__":
    main()
