"""Attention over a batch of sessions: one SDPA per session (what the runtime does) against one SDPA
over the whole batch, padded to its longest cache.

For each batch size, every session holds a cache of its own length (spread around --context) and puts
n new queries into the forward (n = 1: a decode step; n = 8: a small tree). Timed per layer, best of
--repeats, on this machine's torch kernels:
- `per session`: a loop of SDPA calls, each over one session's own cache (no copy);
- `padded, gathered`: the caches copied into one [B, H_kv, L_max, D] tensor, one SDPA under a padding
  mask (what a forward over per-session caches would have to do each layer);
- `padded, resident`: the same SDPA with the caches already in one tensor (no copy: the bound a
  batched cache pool would give).
It also reports whether the padded rows equal the per-session rows bit for bit: greedy identity under
batching rests on a session's logits not depending on who shares its forward. With --forward it times
the engine's own target forward (its model, weights and kernels as configured) over the same batches of
decode steps, so the per-session loop's share of a forward is seen; the shapes are then that model's.

    python scripts/diagnostics/batched_attention.py --forward
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from specserve.runtime.runner import ModelRunner
from specserve.runtime.segment import Segment


def best_of(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(sessions: int, n: int, context: int, heads: int, kv_heads: int, dim: int, repeats: int) -> dict:
    generator = torch.Generator().manual_seed(sessions * 100 + n)
    lengths = [context // 2 + (context * i) // max(1, sessions) for i in range(sessions)]  # spread
    keys = [torch.randn(1, kv_heads, length + n, dim, generator=generator) for length in lengths]
    values = [torch.randn(1, kv_heads, length + n, dim, generator=generator) for length in lengths]
    queries = [torch.randn(1, heads, n, dim, generator=generator) for _ in lengths]
    causal = [
        None
        if n == 1
        else torch.cat([torch.ones(n, length, dtype=torch.bool), torch.ones(n, n).tril().bool()], 1)
        for length in lengths
    ]

    def per_session() -> list[torch.Tensor]:
        return [
            F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
            for q, k, v, m in zip(queries, keys, values, causal, strict=True)
        ]

    longest = max(k.shape[2] for k in keys)
    mask = torch.zeros(sessions, 1, n, longest, dtype=torch.bool)  # [B, 1, n, L_max]
    for i, (k, m) in enumerate(zip(keys, causal, strict=True)):
        mask[i, 0, :, : k.shape[2]] = True if m is None else m
    q_all = torch.cat(queries)  # [B, H, n, D]
    k_pad = torch.zeros(sessions, kv_heads, longest, dim)
    v_pad = torch.zeros(sessions, kv_heads, longest, dim)

    def gather() -> None:
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            k_pad[i, :, : k.shape[2]] = k[0]
            v_pad[i, :, : v.shape[2]] = v[0]

    def padded() -> torch.Tensor:
        return F.scaled_dot_product_attention(q_all, k_pad, v_pad, attn_mask=mask, enable_gqa=True)

    def gathered() -> torch.Tensor:
        gather()
        return padded()

    gather()
    alone = torch.cat(per_session())
    together = padded()
    return {
        "sessions": sessions,
        "new_tokens": n,
        "per_session_ms": 1000 * best_of(per_session, repeats),
        "padded_gathered_ms": 1000 * best_of(gathered, repeats),
        "padded_resident_ms": 1000 * best_of(padded, repeats),
        "bit_identical": bool(torch.equal(alone, together)),
        "max_abs_diff": float((alone - together).abs().max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forward", action="store_true", help="also time the engine's target forward")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--context", type=int, default=400, help="the sessions' mean cache length")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", type=Path, help="write the rows here too")
    args = parser.parse_args()
    heads, kv_heads, dim = args.heads, args.kv_heads, args.head_dim
    runner = None
    if args.forward:
        from specserve.engine import Engine

        runner = Engine().target_runner
        config = runner.model.config
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    torch.set_grad_enabled(False)
    print(
        f"heads {heads}, kv heads {kv_heads}, head size {dim}, context ~{args.context},"
        f" torch {torch.__version__}"
    )
    print("sessions  new  per-session ms  padded+gather ms  padded resident ms  bit-identical  max diff")
    rows = []
    for n in (1, 8):
        for sessions in args.sessions:
            row = measure(sessions, n, args.context, heads, kv_heads, dim, args.repeats)
            rows.append(row)
            print(
                f"{sessions:8d}  {n:3d}  {row['per_session_ms']:14.3f}  {row['padded_gathered_ms']:16.3f}"
                f"  {row['padded_resident_ms']:18.3f}  {row['bit_identical']!s:>13}"
                f"  {row['max_abs_diff']:.1e}"
            )
    if runner is not None:
        for sessions in args.sessions:
            forward_ms = time_forward(runner, sessions, args.context, args.repeats)
            loop_ms = next(r for r in rows if r["sessions"] == sessions and r["new_tokens"] == 1)
            share = loop_ms["per_session_ms"] * runner.num_layers / forward_ms
            print(f"{sessions} decode steps: forward {forward_ms:.2f} ms, attention loop ~{100 * share:.0f}%")
            rows.append({"sessions": sessions, "forward_ms": forward_ms, "attention_share": share})
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


def time_forward(runner: ModelRunner, sessions: int, context: int, repeats: int) -> float:
    """ms of one forward of `sessions` decode steps, each after its own cache of ~context positions."""
    caches = []
    for i in range(sessions):
        length = context // 2 + (context * i) // max(1, sessions)
        cache = runner.new_cache(length + 2 * repeats + 8)
        runner.forward(cache, [(7 * j + i) % 1000 for j in range(length)], last_only=True)
        caches.append(cache)

    def step() -> None:
        segments = [Segment(c, [11], torch.tensor([c.length]), None, True) for c in caches]
        runner.forward_batch(segments)
        for c in caches:
            c.truncate(c.length - 1)  # the step's position goes again: every repeat sees the same caches

    return 1000 * best_of(step, repeats)


if __name__ == "__main__":
    main()
