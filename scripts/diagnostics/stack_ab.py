"""Two local stacks that differ only in their environment (or one), side by side with the in-process engine.

Each prompt runs on the in-process engine, then on stack A, then on stack B, so the three share the
machine's conditions prompt by prompt (as `specserve bench` interleaves its methods), each after an
untimed pause (PAUSE_SECONDS). Greedy, the
default method (or `--method`), the MT-Bench first turns (one per category). docs/benchmarks.md (the
distributed stack) quotes:

    python scripts/diagnostics/stack_ab.py --out /tmp/ab \
        --a 'prepare ahead' SPECSERVE_DRAFT_PREPARE_AHEAD=true \
        --b 'on request' SPECSERVE_DRAFT_PREPARE_AHEAD=false
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

IN_PROCESS = "in-process"
# Between arms, untimed: an OpenMP worker spins for up to libgomp's spin count after its process's last
# forward (milliseconds at the in-process engine's default) and would hold a core the next arm needs.
PAUSE_SECONDS = 0.1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="stack logs and result.json go here")
    parser.add_argument("--a", nargs="+", required=True, metavar=("NAME", "VAR=VALUE"))
    parser.add_argument("--b", nargs="+", metavar=("NAME", "VAR=VALUE"), help="omitted: stack A alone")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--method", default=DEFAULT_METHOD, help="the method, in process and on the stacks")
    args = parser.parse_args()
    arms = {spec[0]: dict(v.split("=", 1) for v in spec[1:]) for spec in (args.a, args.b) if spec}
    prompts = per_category(load_prompts(), 1)
    request = GenerationRequest.build(method=args.method, max_new_tokens=args.max_new_tokens)
    engine = Engine()
    totals = {name: [0, 0.0] for name in [IN_PROCESS, *arms]}  # tokens, seconds
    rounds = {name: [0, 0] for name in arms}  # the stacks' rounds, and those the target ran on its own
    identical = dict.fromkeys(arms, 0)  # prompts whose output is the in-process engine's

    stacks = []
    try:
        for i, (name, env) in enumerate(arms.items()):
            (args.out / f"stack-{i}").mkdir(parents=True, exist_ok=True)
            stacks.append((name, LocalStack(log_dir=args.out / f"stack-{i}", env=env).__enter__()))
        clients = {name: Client(stack.router_address) for name, stack in stacks}
        engine.generate("warm up", GenerationRequest.build(method=args.method, max_new_tokens=8))
        for client in clients.values():
            client.generate("warm up", method=args.method, max_new_tokens=8)
        for i, prompt in enumerate(prompts, 1):
            local: list[int] = []
            for name in totals:
                time.sleep(PAUSE_SECONDS)  # the arm before's OpenMP workers stop spinning first
                start = time.perf_counter()
                if name == IN_PROCESS:
                    tokens = local = engine.generate(prompt.text, request).token_ids
                else:
                    completion = clients[name].generate(
                        prompt.text, method=args.method, max_new_tokens=args.max_new_tokens, temperature=0.0
                    )
                    tokens = completion.token_ids
                    rounds[name][0] += int(completion.stats["num_target_forwards"]) - 1  # not the prefill
                    rounds[name][1] += int(completion.stats["num_ahead_rounds"])
                    identical[name] += tokens == local
                totals[name][0] += len(tokens)
                totals[name][1] += time.perf_counter() - start
            rates = {name: round(n / s, 2) for name, (n, s) in totals.items()}
            print(f"prompt {i}/{len(prompts)} tokens/s so far: {rates}", flush=True)
    finally:
        for _, stack in reversed(stacks):
            stack.__exit__(None, None, None)

    result = {name: {"tokens_per_s": n / s} for name, (n, s) in totals.items()}
    for name in arms:
        result[name]["vs_in_process"] = result[name]["tokens_per_s"] / result[IN_PROCESS]["tokens_per_s"]
        result[name]["rounds"], result[name]["ahead_rounds"] = rounds[name]
        result[name]["identical"] = f"{identical[name]}/{len(prompts)}"
    result["arms"] = arms
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
