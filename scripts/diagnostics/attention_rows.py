"""What the compiled attention costs per query row, by rows and cached positions (the default model's
shape: 9 query heads over 3 key/value heads of 64, 30 layers).

A tree of n nodes attends n rows over the whole cache; each row reads every cached position once per
query head, so past a few hundred positions attention, not the weights, is most of a verify forward.
docs/benchmarks.md ("The CPU's own kernels") quotes:

    python scripts/diagnostics/attention_rows.py --lengths 200,800 --rows 1,2,4,8
"""

from __future__ import annotations

import argparse
import time

import torch

from specserve.runtime import cpu_kernels

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30


def per_call_s(rows: int, length: int, calls: int) -> float:
    """The mean time of one layer's attention over `calls` calls, after 20 warm-up calls."""
    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(1, KV_HEADS, length, HEAD_DIM, generator=generator) for _ in "kv")
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=generator)
    visible = torch.ones(rows, length, dtype=torch.bool)
    for _ in range(20):
        cpu_kernels.attend(q, keys, values, visible, HEAD_DIM**-0.5)
    start = time.perf_counter()
    for _ in range(calls):
        cpu_kernels.attend(q, keys, values, visible, HEAD_DIM**-0.5)
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="200,800", help="cached positions, comma-separated")
    parser.add_argument("--rows", default="1,2,4,8", help="query rows (tree nodes), comma-separated")
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    if cpu_kernels.library() is None:
        raise SystemExit("the CPU kernels did not build on this host")
    print(f"torch threads: {torch.get_num_threads()}")
    for length in map(int, args.lengths.split(",")):
        for rows in map(int, args.rows.split(",")):
            forward_ms = 1e3 * LAYERS * per_call_s(rows, length, args.calls)
            per_row = forward_ms / rows
            print(f"{length:5d} positions, {rows:2d} rows: {forward_ms:6.2f} ms, {per_row:5.2f} a row")


if __name__ == "__main__":
    main()
