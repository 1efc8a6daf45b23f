"""What a round costs where the target runs it on its own (core/ahead.py), against a round of the same
method in process.

A local stack serves the MT-Bench first turns (one per category, greedy, the default method) for a
while; its target process times every round it runs ahead (the verify, and the whole round with its
drafting), through a `sitecustomize` this script puts on the stack's PYTHONPATH that wraps
`specserve.core.ahead.run_ahead` and writes its sums to the log directory. Then the in-process engine
runs the same prompts, and its rounds are timed from its stats. docs/benchmarks.md ("Rounds beside the
target") quotes:

    python scripts/diagnostics/ahead_round_cost.py --out /tmp/ahead-cost
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specserve.bench.prompts import load_prompts, per_category
from specserve.catalog import DEFAULT_METHOD
from specserve.client import Client
from specserve.core.request import GenerationRequest
from specserve.engine import Engine
from specserve.serving.stack import LocalStack

# Loaded by every process of the stack (Python imports `sitecustomize` at start-up); it acts only where
# AHEAD_COST_FILE is set, and it wraps `run_ahead` before the target's servicer imports it.
SITECUSTOMIZE = """
import json, os, time
if os.environ.get("AHEAD_COST_FILE"):
    import specserve.core.ahead as ahead
    run_ahead, sums = ahead.run_ahead, {"calls": 0, "rounds": 0, "nodes": 0, "verify_s": 0.0, "run_s": 0.0}

    def timed_run_ahead(first, token_ids, drafter, verify, *args, **kwargs):
        def timed_verify(draft):
            start = time.perf_counter()
            try:
                return verify(draft)
            finally:
                sums["verify_s"] += time.perf_counter() - start
                sums["rounds"] += 1
                sums["nodes"] += draft.tree.num_nodes
        start = time.perf_counter()
        try:
            return run_ahead(first, token_ids, drafter, timed_verify, *args, **kwargs)
        finally:
            sums["run_s"] += time.perf_counter() - start
            sums["calls"] += 1
            with open(os.environ["AHEAD_COST_FILE"] + f".{os.getpid()}", "w") as out:
                json.dump(sums, out)

    ahead.run_ahead = timed_run_ahead
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the stack's logs and the sums go here")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long the stack serves")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    hook = args.out / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    sums = args.out / "ahead"
    prompts = per_category(load_prompts(), 1)
    env = {"PYTHONPATH": str(hook), "AHEAD_COST_FILE": str(sums)}
    with LocalStack(log_dir=args.out / "stack", env=env) as stack:
        client = Client(stack.router_address)
        client.generate("warm up", method=DEFAULT_METHOD, max_new_tokens=8)
        for stale in args.out.glob("ahead.*"):
            stale.unlink()
        start, tokens = time.perf_counter(), 0
        while time.perf_counter() - start < args.seconds:
            for prompt in prompts:
                completion = client.generate(
                    prompt.text, method=DEFAULT_METHOD, max_new_tokens=args.max_new_tokens, temperature=0.0
                )
                tokens += len(completion.token_ids)
        stack_rate = tokens / (time.perf_counter() - start)
    (ahead,) = [json.loads(p.read_text()) for p in args.out.glob("ahead.*")]  # the target's process

    engine = Engine()
    request = GenerationRequest.build(method=DEFAULT_METHOD, max_new_tokens=args.max_new_tokens)
    engine.generate("warm up", request)
    totals = dict.fromkeys(("elapsed_s", "draft_s", "num_target_forwards", "num_draft_tokens"), 0.0)
    generated = 0
    for prompt in prompts:
        result = engine.generate(prompt.text, request)
        generated += len(result.token_ids)
        for key in totals:
            totals[key] += float(getattr(result.stats, key))
    rounds = totals["num_target_forwards"] - len(prompts)  # not the prefills
    report = {
        "stack_tokens_per_s": stack_rate,
        "ahead_rounds": ahead["rounds"],
        "ahead_calls": ahead["calls"],
        "ahead_ms_per_round": 1e3 * ahead["run_s"] / ahead["rounds"],
        "ahead_verify_ms_per_round": 1e3 * ahead["verify_s"] / ahead["rounds"],
        "ahead_nodes_per_round": ahead["nodes"] / ahead["rounds"],
        "in_process_tokens_per_s": generated / totals["elapsed_s"],
        "in_process_ms_per_round": 1e3 * totals["elapsed_s"] / rounds,  # its prefills included
        "in_process_nodes_per_round": 1 + totals["num_draft_tokens"] / rounds,
    }
    (args.out / "result.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
