"""What the int8-dot product costs by rows, at the default model's four layer shapes (4-bit codes with
fp16 scales, as its file's Q4_1 weights are packed), against the time its integer products alone
would take.

The floor assumes one 512-bit `vpdpbusd` (64 multiply-adds) a cycle on each thread at `--ghz`: a
product of n outputs, k inputs and r rows needs n * k * r / 64 of them. docs/benchmarks.md ("The CPU's
own kernels") quotes:

    python scripts/diagnostics/product_rows.py --rows 1,8 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from specserve.runtime import cpu_kernels

SHAPES = {"q, k, v": (960, 576), "o": (576, 576), "gate, up": (3072, 576), "down": (576, 1536)}
MACS_PER_INSTRUCTION = 64


def packed(n: int, k: int, seed: int = 0) -> cpu_kernels.DotLayout:
    """A random 4-bit weight [n, k] whose scales and zeros are fp16 values (the kernel's fp16 layout)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    scales = (rng.random((n, k // 32)) * 0.01).astype(np.float16).astype(np.float32)
    zeros = (rng.random((n, k // 32)) * 0.01).astype(np.float16).astype(np.float32)
    return cpu_kernels.pack(codes, scales, zeros)


def median_us(x: torch.Tensor, weight: cpu_kernels.DotLayout, calls: int) -> float:
    for _ in range(20):
        cpu_kernels.dot_mm(x, weight)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        cpu_kernels.dot_mm(x, weight)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--ghz", type=float, default=3.7, help="the clock the floor assumes")
    args = parser.parse_args()
    if cpu_kernels.library() is None:
        raise SystemExit("the CPU kernels are not built on this host")
    torch.set_num_threads(args.threads)
    totals: dict[int, float] = {}
    floors: dict[int, float] = {}
    for name, (n, k) in SHAPES.items():
        weight = packed(n, k)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            spent = median_us(x, weight, args.calls)
            floor = n * k * rows / MACS_PER_INSTRUCTION / args.threads / (args.ghz * 1e3)
            totals[rows] = totals.get(rows, 0.0) + spent
            floors[rows] = floors.get(rows, 0.0) + floor
            print(f"{name:9s} {n}x{k}, {rows:2d} rows: {spent:7.1f} us (integer products: {floor:5.1f} us)")
    for rows, spent in totals.items():
        floor = floors[rows]
        print(f"a layer's four products, {rows:2d} rows: {spent:7.1f} us (integer products: {floor:5.1f} us)")


if __name__ == "__main__":
    main()
