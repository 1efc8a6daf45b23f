"""Prefix routing measured: document questions through a stack of two target replicas, the router's
prefix routing on and then off (one fresh stack per arm, so both start from empty caches).

Each arm asks `--questions` questions about each of `--limit` ~1,500-token documents (the doc-qa
workload of `specserve bench`, bench/sessions.py), ordered round-robin over the documents (every
document's first question, then every second one, ...) and sent by `--clients` concurrent clients, each
taking the next question when its last one ends. So while one replica is busy the other is often idle:
placement by load alone sends a later question to whichever is idle, often not where its document was
prefilled; prefix routing sends it to that replica while it is at most `prefix_routing_slack` sessions
busier. Per arm: the share of prompt tokens taken from the targets' caches, TTFT of first and later
questions, tok/s (generated tokens over the arm's requests' summed time), and whether every answer equals
the other arm's (greedy; a cached prefix answers as a cold one).

    python scripts/diagnostics/prefix_routing.py --out docs/results/prefix-routing-2-replicas-1.json

`--log-dir` keeps the stacks' logs (default: private temporary directories, removed at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specserve.bench.machine import machine_info
from specserve.bench.sessions import (
    DOC_QUESTIONS,
    Script,
    TurnResult,
    doc_qa_scripts,
    remote_generate,
    summarize,
)
from specserve.client import Client
from specserve.core.request import GenerationRequest
from specserve.models.chat import encode_messages
from specserve.models.loading import load_tokenizer, resolve_model_dir
from specserve.serving.stack import LocalStack
from specserve.settings import EngineSettings

METHOD = "remote:target"  # the target alone: what is measured is where prefills land, not drafting
ARMS = {"off": "false", "on": "true"}  # SPECSERVE_ROUTER_PREFIX_ROUTING; off first, as `bench` does
Job = tuple[Script, int, list[int]]  # a document, the question's index, the prompt's token ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=2, help="documents (one per grounded category)")
    parser.add_argument("--questions", type=int, default=len(DOC_QUESTIONS), help="questions per document")
    parser.add_argument("--clients", type=int, default=2, help="concurrent clients")
    parser.add_argument("--replicas", type=int, default=2, help="target replicas")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, help="the results JSON")
    parser.add_argument("--log-dir", type=Path, help="keep each arm's stack logs under this directory")
    args = parser.parse_args()

    settings = EngineSettings.from_env()
    tokenizer = load_tokenizer(resolve_model_dir(settings.model_dir, settings.cache_dir, settings.model))
    scripts = doc_qa_scripts(tokenizer, args.limit)
    jobs = [
        (script, turn, prompt_ids(tokenizer, script, turn))
        for turn in range(args.questions)
        for script in scripts
    ]
    request = GenerationRequest.build(method="target", max_new_tokens=args.max_new_tokens)
    runs = {arm: run_arm(arm, routing, jobs, request, args) for arm, routing in ARMS.items()}
    result = report(runs, args)
    print(json.dumps(result["summary"], indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")


def prompt_ids(tokenizer: Any, script: Script, turn: int) -> list[int]:
    """The document then one question, as one user message through the chat template (as doc-qa asks)."""
    messages = [{"role": "user", "content": f"{script.document}\n\n{script.turns[turn]}"}]
    return encode_messages(tokenizer, messages, add_generation_prompt=True)


def run_arm(
    arm: str, routing: str, jobs: list[Job], request: GenerationRequest, args: argparse.Namespace
) -> dict[str, Any]:
    log_dir = None if args.log_dir is None else args.log_dir / f"routing-{arm}"
    env = {"SPECSERVE_ROUTER_PREFIX_ROUTING": routing}
    print(
        f"[{arm}] starting a stack of {args.replicas} target replicas (prefix routing {routing})", flush=True
    )
    with LocalStack(
        log_dir=log_dir, env=env, roles=("target", "router"), target_replicas=args.replicas
    ) as stack:
        warm_up(stack.router_address, args.replicas)
        load_before = os.getloadavg()[0]
        started = time.perf_counter()
        turns = ask_concurrently(arm, stack.router_address, jobs, request, args.clients, started)
        wall = time.perf_counter() - started
    return {"turns": turns, "wall_s": wall, "load_average": [load_before, os.getloadavg()[0]]}


def warm_up(address: str, replicas: int) -> None:
    """A short request per replica at once (placed by load, one each): the first forward of a fresh
    process is slow, and no arm should time it. Short prompts fill no cache block."""

    def hello() -> None:
        with Client(address) as client:
            client.generate("Hello.", method="target", max_new_tokens=4)

    threads = [threading.Thread(target=hello) for _ in range(replicas)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def ask_concurrently(
    arm: str, address: str, jobs: list[Job], request: GenerationRequest, clients: int, started: float
) -> list[TurnResult]:
    """Each client takes the next job when its last one ended; results in the jobs' order."""
    pending: queue.Queue[tuple[int, Job]] = queue.Queue()
    for index, job in enumerate(jobs):
        pending.put((index, job))
    results: dict[int, TurnResult] = {}

    def client_loop(name: int) -> None:
        with Client(address) as client:
            generate = remote_generate(client, METHOD)
            while True:
                try:
                    index, job = pending.get_nowait()
                except queue.Empty:
                    return
                results[index] = ask(generate, job, request)
                t = results[index]
                print(
                    f"[{arm}] {time.perf_counter() - started:6.1f} s  client {name}  {t.script_id} "
                    f"q{t.turn + 1}: {t.cached_tokens}/{t.prompt_tokens} cached, TTFT {t.ttft_s:.2f} s, "
                    f"{t.elapsed_s:.2f} s",
                    flush=True,
                )

    threads = [threading.Thread(target=client_loop, args=(n,)) for n in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [results[i] for i in range(len(jobs))]


def ask(generate: Any, job: Job, request: GenerationRequest) -> TurnResult:
    script, turn, ids = job
    first: list[float] = []
    start = time.perf_counter()
    result = generate(ids, request, lambda tokens: first.append(time.perf_counter()) if not first else None)
    elapsed = time.perf_counter() - start
    stats = result.stats
    return TurnResult(
        script.script_id,
        turn,
        len(ids),
        stats.num_cached_tokens,
        (first[0] if first else start + elapsed) - start,
        elapsed,
        stats.num_generated_tokens,
        list(result.token_ids),
    )


def report(runs: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Per arm the bench's doc-qa summary (on compared with off), its wall time and load average."""
    off = runs["off"]["turns"]
    summary: dict[str, Any] = {}
    for arm, run in runs.items():
        summary[arm] = summarize(run["turns"], off if arm == "on" else None)
        generated = sum(t.generated_tokens for t in run["turns"])
        summary[arm] |= {
            "wall_s": run["wall_s"],
            "throughput_tokens_per_s": generated / run["wall_s"],  # all clients together
            "load_average_before_after": run["load_average"],
        }
    on, off_summary = summary["on"], summary["off"]
    if on["ttft_later_turns_s"] and off_summary["ttft_later_turns_s"]:
        summary["later_ttft_on_over_off"] = on["ttft_later_turns_s"] / off_summary["ttft_later_turns_s"]
    if off_summary["tokens_per_s"]:
        summary["tokens_per_s_on_over_off"] = on["tokens_per_s"] / off_summary["tokens_per_s"]
    return {
        "summary": summary,
        "turns": {arm: [asdict(t) for t in run["turns"]] for arm, run in runs.items()},
        "config": {
            "method": METHOD,
            "target_replicas": args.replicas,
            "clients": args.clients,
            "documents": args.limit,
            "questions_per_document": args.questions,
            "max_new_tokens": args.max_new_tokens,
            "temperature": 0.0,
            "order": "round-robin over documents; each client takes the next question when its last ends",
        },
        "machine": machine_info(EngineSettings.from_env()),
    }


if __name__ == "__main__":
    main()
