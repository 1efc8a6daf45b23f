"""`specserve bench --concurrency 1,4,8,16`: throughput and latency under load.

At each level N, N sessions start together and run to the end (a closed batch: it ends with its slowest
session); with `requests` M, M requests are queued at once and at most N run at a time, the next
starting as soon as one finishes (a server holding N sessions under steady demand: throughput rather
than the slowest session; time to first token then includes the wait for a slot, in-process only).
Every method runs at every level
(interleaved: all methods at one level before the next level). In-process, the sessions run through
`Engine.generate_many` (continuously batched); with a `remote:` method, N client threads stream from
the router at once. Measured per level: aggregate tokens/s (all tokens / wall time), time to first
token and inter-token latency (p50, p99; a burst of k accepted tokens counts as k tokens each 1/k of
the gap), the target's tokens per forward (in-process), and whether every session's output equals the
same prompt's output at N = 1 (greedy: token for token).
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tqdm import tqdm

from specserve.bench.runner import forget_prompts
from specserve.core.request import GenerationRequest
from specserve.errors import InvalidArgument

REMOTE_PREFIX = "remote:"
LLAMA_CPP_PREFIX = "llama.cpp"


@dataclass
class _Timeline:
    """When one session's tokens arrived."""

    start: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens in that emission)
    token_ids: list[int] = field(default_factory=list)

    def record(self, token_ids: Sequence[int]) -> None:
        self.arrivals.append((time.perf_counter(), len(token_ids)))
        self.token_ids.extend(token_ids)

    @property
    def ttft(self) -> float | None:
        return self.arrivals[0][0] - self.start if self.arrivals else None

    def inter_token(self) -> list[float]:
        gaps = []
        for (t0, _), (t1, count) in zip(self.arrivals, self.arrivals[1:], strict=False):
            gaps.extend([(t1 - t0) / count] * count)
        return gaps


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidArgument(
            f"--concurrency must be a comma-separated list of integers, got {text!r}"
        ) from None
    if not levels or any(n < 1 or n > 256 for n in levels):
        raise InvalidArgument(f"--concurrency levels must be in [1, 256], got {text!r}")
    return sorted(set(levels))


def _in_process(engine: Any) -> Any:
    """The in-process engine behind a bench wrapper (llama.cpp's peers: bench/llamacpp.WithLlamaCpp)."""
    return getattr(engine, "engine", engine)


def _run_in_process(
    engine: Any, prompts: Sequence[str], request: GenerationRequest, max_concurrent: int | None = None
) -> dict:
    engine = _in_process(engine)
    ids = [engine.encode_prompt(p) for p in prompts]
    timelines = [_Timeline(0.0) for _ in prompts]
    start = time.perf_counter()
    for timeline in timelines:
        timeline.start = start
    results = engine.generate_many(ids, request, [t.record for t in timelines], max_concurrent=max_concurrent)
    wall = time.perf_counter() - start
    stats = engine.last_batch_stats
    target = stats.per_model.get("target", (0, 0))
    return {
        "wall_s": wall,
        "timelines": timelines,
        "token_ids": [r.token_ids for r in results],
        "num_accepted_tokens": sum(r.stats.num_accepted_tokens for r in results),
        "num_rounds": sum(r.stats.num_target_forwards for r in results),
        "target_forwards": target[0],
        "target_tokens_per_forward": target[1] / target[0] if target[0] else None,
        # Seconds inside each model's forwards (label -> s); the rest of wall_s is everything else.
        "forward_seconds": dict(stats.seconds_per_model),
    }


def _run_remote(address: str, prompts: Sequence[str], request: GenerationRequest) -> dict:
    from specserve.bench.remote import client_options
    from specserve.client import Client

    timelines = [_Timeline(0.0) for _ in prompts]
    errors: list[str] = []
    stats: list[dict[str, float]] = [{} for _ in prompts]
    with Client(address) as client:
        barrier = threading.Barrier(len(prompts))

        def session(i: int) -> None:
            barrier.wait()
            timelines[i].start = time.perf_counter()
            try:
                for chunk in client.stream(prompts[i], timeout=3600, **client_options(request)):
                    if chunk.token_ids:
                        timelines[i].record(chunk.token_ids)
                    if chunk.stats:
                        stats[i] = chunk.stats
            except Exception as exc:  # counted and reported: errors under load are a result
                errors.append(f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=session, args=(i,)) for i in range(len(prompts))]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        "timelines": timelines,
        "token_ids": [t.token_ids for t in timelines],
        "num_accepted_tokens": sum(int(s.get("num_accepted_tokens", 0)) for s in stats),
        "num_rounds": sum(int(s.get("num_target_forwards", 0)) for s in stats),
        "errors": errors,
    }


def _run_llamacpp(engine: Any, method: str, prompts: Sequence[str], request: GenerationRequest) -> dict:
    """N sessions at once on a llama-server with N slots (bench/llamacpp.py), streamed."""
    ids = [_in_process(engine).encode_prompt(p) for p in prompts]
    timelines = [_Timeline(0.0) for _ in prompts]
    start = time.perf_counter()
    for timeline in timelines:
        timeline.start = start
    engine.stream_many(method, ids, request, [t.record for t in timelines])
    wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        "timelines": timelines,
        "token_ids": [t.token_ids for t in timelines],
        "num_accepted_tokens": 0,
        "num_rounds": 0,
    }


def run_concurrency(
    engine: Any,
    prompts: Sequence[str],
    methods: Sequence[str],
    levels: Sequence[int],
    request: GenerationRequest,
    remote_address: str | None = None,
    progress: bool = True,
    requests: int | None = None,
) -> dict[str, Any]:
    """Every method at every level; returns {method: {level: figures}} plus each level's prompts.
    requests: M queued requests served at most `level` at a time (module doc); None = a closed batch."""
    if not prompts:
        raise InvalidArgument("no prompts to benchmark")
    if any(m.startswith(REMOTE_PREFIX) for m in methods) and remote_address is None:
        raise InvalidArgument("remote: methods need --remote HOST:PORT")
    outside = (REMOTE_PREFIX, LLAMA_CPP_PREFIX)
    if requests is not None and (requests < 1 or any(m.startswith(outside) for m in methods)):
        raise InvalidArgument(
            "--requests must be >= 1 and runs in process only (no remote: or llama.cpp methods)"
        )

    def run(method: str, batch: Sequence[str], request: GenerationRequest, slots: int) -> dict:
        if method.startswith(LLAMA_CPP_PREFIX):
            return _run_llamacpp(engine, method, batch, replace(request, method=method))
        if method.startswith(REMOTE_PREFIX):
            assert remote_address is not None
            remote = replace(request, method=method.removeprefix(REMOTE_PREFIX))
            return _run_remote(remote_address, batch, remote)
        forget_prompts(engine)  # each method prefills its prompts itself, as the others do
        return _run_in_process(engine, batch, replace(request, method=method), slots)

    # Warm-up: lazy loading, allocator growth and kernel choice are paid before anything is timed.
    stopping = replace(request.stopping, max_new_tokens=min(8, request.stopping.max_new_tokens))
    warmup = replace(request, stopping=stopping)
    for method in methods:
        run(method, _take(prompts, min(4, max(levels))), warmup, min(4, max(levels)))
    alone: dict[str, dict[str, list[int]]] = {m: {} for m in methods}
    figures: dict[str, dict[str, Any]] = {m: {} for m in methods}
    total = len(levels) * len(methods)
    bar = tqdm(total=total, desc="concurrency", unit="run", file=sys.stderr, disable=not progress)
    try:
        for level in levels:
            batch = _take(prompts, requests or level)
            for method in methods:
                out = run(method, batch, request, level)
                figures[method][str(level)] = _figures(out, batch, alone[method], level)
                bar.set_postfix_str(
                    f"{method} x{level}: {figures[method][str(level)]['tokens_per_s']:.1f} tok/s",
                    refresh=False,
                )
                bar.update(1)
    finally:
        bar.close()
    return {"levels": list(levels), "requests": requests, "methods": figures}


def _take(prompts: Sequence[str], n: int) -> list[str]:
    """n prompts, cycling through the list when it is shorter."""
    return [prompts[i % len(prompts)] for i in range(n)]


def _figures(out: dict, batch: Sequence[str], alone: dict[str, list[int]], level: int) -> dict[str, Any]:
    tokens = sum(len(ids) for ids in out["token_ids"])
    ttft = [t.ttft for t in out["timelines"] if t.ttft is not None]
    itl = [gap for t in out["timelines"] for gap in t.inter_token()]
    same = []
    for prompt, ids in zip(batch, out["token_ids"], strict=True):
        if prompt not in alone:
            alone[prompt] = ids  # the first (lowest) level that ran this prompt is the reference
        same.append(alone[prompt] == ids)
    figures = {
        "sessions": level,
        "requests": len(batch),
        "tokens": tokens,
        "wall_s": round(out["wall_s"], 3),
        "tokens_per_s": tokens / out["wall_s"] if out["wall_s"] > 0 else 0.0,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50),
        "itl_p99_s": percentile(itl, 99),
        "mean_accepted_length": out["num_accepted_tokens"] / out["num_rounds"] if out["num_rounds"] else None,
        "identical_to_lowest_level": all(same),
        "num_identical": sum(same),
    }
    if "target_tokens_per_forward" in out:
        figures["target_forwards"] = out["target_forwards"]
        figures["target_tokens_per_forward"] = out["target_tokens_per_forward"]
        figures["forward_seconds"] = {k: round(v, 3) for k, v in out["forward_seconds"].items()}
    if "errors" in out:
        figures["errors"] = len(out["errors"])
        figures["error_examples"] = sorted(set(out["errors"]))[:3]
    return figures


def format_concurrency(result: dict[str, Any]) -> str:
    lines = [
        f"{'method':<24} {'N':>4} {'tok/s':>8} {'TTFT p50':>9} {'ITL p50':>8} {'ITL p99':>8} "
        f"{'tok/fwd':>8} {'same':>5}"
    ]
    for method, by_level in result["methods"].items():
        for level, f in by_level.items():
            lines.append(
                f"{method:<24} {level:>4} {f['tokens_per_s']:>8.1f} {_ms(f['ttft_p50_s']):>9} "
                f"{_ms(f['itl_p50_s']):>8} {_ms(f['itl_p99_s']):>8} "
                f"{_num(f.get('target_tokens_per_forward')):>8} "
                f"{f['num_identical']:>2}/{f.get('requests', f['sessions']):<2}"
            )
    return "\n".join(lines)


def plot_concurrency(result: dict[str, Any], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method, by_level in result["methods"].items():
        levels = [int(n) for n in by_level]
        left.plot(levels, [f["tokens_per_s"] for f in by_level.values()], marker="o", label=method)
        right.plot(
            levels, [(f["itl_p50_s"] or 0) * 1000 for f in by_level.values()], marker="o", label=method
        )
    left.set(xlabel="concurrent sessions", ylabel="aggregate tokens/s", title="Throughput")
    right.set(xlabel="concurrent sessions", ylabel="inter-token latency p50 (ms)", title="Latency")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}ms"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
