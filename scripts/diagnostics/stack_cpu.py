"""CPU seconds each process of a local stack spends while it serves: the target (and each of its threads),
the draft, the router, Redis and this client, from /proc, over the MT-Bench first turns (one per
category, greedy, the default method, 64 new tokens each).

With `--sessions 1` the requests run one after another (the one-session case the stack is compared with
in process); with more, that many at once over the first 32 prompts. docs/benchmarks.md (rounds beside
the target) quotes:

    python scripts/diagnostics/stack_cpu.py --out /tmp/cpu
    python scripts/diagnostics/stack_cpu.py --out /tmp/cpu16 --sessions 16
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from specserve.bench.prompts import Prompt, load_prompts, per_category
from specserve.catalog import DEFAULT_METHOD
from specserve.client import Client
from specserve.serving.stack import LocalStack

TICKS = os.sysconf("SC_CLK_TCK")
NEW_TOKENS = 64


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU of a process (or one of its threads) so far."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    with open(path) as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def snapshot(processes: dict[str, int]) -> dict[str, float]:
    """Every process's CPU, and each of the target's threads' (threads that ended are left out)."""
    seconds = {name: cpu_seconds(pid) for name, pid in processes.items()}
    target = processes["target"]
    for tid in os.listdir(f"/proc/{target}/task"):
        try:
            seconds[f"target thread {tid}"] = cpu_seconds(target, int(tid))
        except OSError:
            continue
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the stack's logs go here")
    parser.add_argument("--sessions", type=int, default=1, help="requests at once")
    args = parser.parse_args()
    prompts = per_category(load_prompts(), 1) if args.sessions == 1 else load_prompts()[:32]
    with LocalStack(log_dir=args.out) as stack:
        client = Client(stack.router_address)
        client.generate("warm up", method=DEFAULT_METHOD, max_new_tokens=8)
        processes = {name: process.pid for name, process in stack.processes.items()}
        processes["client"] = os.getpid()

        def generate(prompt: Prompt) -> int:
            completion = client.generate(
                prompt.text, method=DEFAULT_METHOD, max_new_tokens=NEW_TOKENS, temperature=0.0
            )
            return len(completion.token_ids)

        before = snapshot(processes)
        start = time.perf_counter()
        with ThreadPoolExecutor(args.sessions) as pool:
            tokens = sum(pool.map(generate, prompts))
        wall = time.perf_counter() - start
        after = snapshot(processes)
    print(f"{tokens} tokens in {wall:.2f} s ({tokens / wall:.1f} tok/s), {args.sessions} at once")
    for name, seconds in after.items():
        spent = seconds - before.get(name, seconds)
        if spent > 0.005:
            print(
                f"  {name:24s} {spent:6.2f} s CPU ({spent / wall * 100:5.1f}% of a core, "
                f"{spent / tokens * 1e3:.3f} ms a token)"
            )


if __name__ == "__main__":
    main()
