"""The `specserve bench` subcommand."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specserve.app.sampling_args import add_sampling_options, request_from_args
from specserve.bench.workloads import resolve_prompts_path
from specserve.core.request import GenerationRequest
from specserve.errors import InvalidArgument
from specserve.settings import DEFAULT_PREFIX_CACHE_BYTES, EngineSettings

if TYPE_CHECKING:
    from specserve.bench.prompts import Prompt

DEFAULT_METHODS = "target,hf,vanilla"


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `bench` on the top-level CLI's subparsers; returns the new parser."""
    p = subparsers.add_parser(
        "bench",
        help="benchmark decoding methods against plain target decoding",
        description="Run every method on every prompt (interleaved) and report tok/s, speedup over "
        "`target`, mean accepted length, acceptance rate and how many outputs equal the target's.",
    )
    p.add_argument(
        "--prompts",
        metavar="NAME|FILE.jsonl",
        help="a workload: mt-bench (the default; 80 questions, 8 categories) or grounded (32 code edits, "
        "extractions, summaries and code explanations whose answers repeat much of the prompt), or an "
        "MT-Bench-format JSONL file",
    )
    p.add_argument(
        "--limit",
        type=int,
        metavar="N",
        help="use only the first N prompts (of the --per-category selection)",
    )
    p.add_argument(
        "--per-category", type=int, metavar="N", help="use only the first N prompts of each category"
    )
    p.add_argument(
        "--methods",
        default=DEFAULT_METHODS,
        metavar="M1,M2",
        help=f"comma-separated methods (default: {DEFAULT_METHODS}), by name or by their axes "
        "(DRAFT[+TREE[-DEPTH]][+STOP][+suffix], e.g. vanilla+chain-2+gated+suffix); target is always run",
    )
    add_sampling_options(p, default_seed=0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument(
        "--no-constraints",
        action="store_true",
        help="run a workload's prompts without their schemas (json-extraction: the unconstrained baseline)",
    )
    p.add_argument("--out", type=Path, metavar="results.json", help="write the full result as JSON")
    p.add_argument("--plot", type=Path, metavar="results.png", help="write a PNG figure")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument(
        "--concurrency",
        metavar="N1,N2",
        help="throughput under load instead: at each level N, N sessions run at once (continuously "
        "batched in-process; remote:<method> streams N at once from the router); e.g. 1,4,8,16",
    )
    p.add_argument(
        "--requests",
        type=int,
        metavar="M",
        help="with --concurrency: M requests queued at once, at most N running at a time, each next one "
        "starting as one finishes (throughput under steady demand; in process only)",
    )
    p.add_argument(
        "--remote",
        metavar="HOST:PORT",
        help="also offer the router's methods as remote:<method> (e.g. --methods glide,remote:glide)",
    )
    p.add_argument(
        "--workload",
        choices=("multi-turn", "doc-qa", "doc-chat"),
        help="requests that share a prefix instead of the method table, timed with the prefix cache off "
        "and on: multi-turn (MT-Bench's two turns, the second carrying the first answer; --prompts for "
        "another file), doc-qa (four questions about each ~1,500-token document) or doc-chat (the same "
        "questions as one conversation over the document, each turn carrying the earlier answers); "
        "--limit N takes N conversations or documents",
    )
    p.add_argument(
        "--prefix-cache",
        choices=("both", "on", "off"),
        default="both",
        help="with --workload: the in-process engine's prefix cache settings to run (default both)",
    )
    p.add_argument(
        "--llama-server",
        metavar="PATH",
        help="llama.cpp's llama-server binary for the llama.cpp peer methods (llama.cpp, llama.cpp-ngram, "
        "llama.cpp-draft) on the profile's own GGUF file (default: $LLAMA_SERVER)",
    )
    return p


def run_bench_command(
    args: argparse.Namespace,
    settings: EngineSettings,
    engine_factory: Callable[[EngineSettings], Any] | None = None,
) -> int:
    """Validate everything cheap first, then load the engine, run, print the table, write files.

    `engine_factory` exists for tests; by default it is specserve.engine.Engine.
    """
    # Imported here: they pull in tqdm/matplotlib, which `specserve --help` should not pay for.
    from specserve.bench.prompts import load_prompts, per_category

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise InvalidArgument(f"--methods must list at least one method, got {args.methods!r}")
    from specserve.engine import request_limits

    request = request_from_args(args, request_limits(settings))
    prompts_path = resolve_prompts_path(args.prompts)
    if args.limit is not None and args.limit < 1:
        raise InvalidArgument(f"--limit must be >= 1, got {args.limit}")
    prompts = load_prompts(prompts_path, args.limit if args.per_category is None else None)
    if args.per_category is not None:
        # The limit applies to the selection: --per-category 1 --limit 2 = the first two categories.
        prompts = per_category(prompts, args.per_category)[: args.limit]
    # A run can take hours; find an unwritable output path before it, not after.
    for path in (args.out, args.plot):
        if path is not None:
            _check_writable(path)

    if engine_factory is None:
        from specserve.engine import Engine

        engine_factory = Engine
    engine = engine_factory(settings)
    peers = None
    if any(m.startswith("llama.cpp") for m in methods):
        from specserve.bench.llamacpp import WithLlamaCpp, server_binary

        server_binary(getattr(args, "llama_server", None))  # a clear error before anything runs
        engine = peers = WithLlamaCpp(engine, settings.model, getattr(args, "llama_server", None))
    try:
        return _run_measurements(args, engine, prompts, prompts_path, methods, request, settings)
    finally:
        if peers is not None:
            peers.close()


def _run_measurements(
    args: argparse.Namespace,
    engine: Any,
    prompts: list[Prompt],
    prompts_path: Path,
    methods: list[str],
    request: GenerationRequest,
    settings: EngineSettings,
) -> int:
    from specserve.bench.report import format_table, plot
    from specserve.bench.runner import run_bench

    if getattr(args, "workload", None):
        return _run_session_workload(args, engine, prompts_path, methods, request, settings)
    if getattr(args, "concurrency", None):
        return _run_concurrency(args, engine, [p.text for p in prompts], methods, request, settings)
    remote = None
    if getattr(args, "remote", None):
        from specserve.bench.remote import WithRemote

        engine = remote = WithRemote(engine, args.remote)
    result = run_bench(
        engine,
        prompts,
        methods,
        request,
        progress=not getattr(args, "no_progress", False),
        settings=settings,
        prompts_file=prompts_path,
        limit=args.limit,
        constrain=not args.no_constraints,
        settle=True,
    )
    if remote is not None:
        result["remote_breakdown"] = remote.breakdown()
    print(format_table(result))
    if remote is not None:
        print(remote.format_breakdown())
    _write_outputs(args, result, lambda p: plot(result, p))
    return 0


def _run_concurrency(
    args: argparse.Namespace,
    engine: Any,
    prompts: list[str],
    methods: list[str],
    request: GenerationRequest,
    settings: EngineSettings,
) -> int:
    from specserve.bench.concurrency import (
        format_concurrency,
        parse_levels,
        plot_concurrency,
        run_concurrency,
    )
    from specserve.bench.machine import machine_info

    levels = parse_levels(args.concurrency)
    if "target" not in methods:
        methods = ["target", *methods]  # batching alone: the baseline at every level
    concurrency = run_concurrency(
        engine,
        prompts,
        methods,
        levels,
        request,
        remote_address=getattr(args, "remote", None),
        progress=not getattr(args, "no_progress", False),
        requests=getattr(args, "requests", None),
    )
    result = {
        "concurrency": concurrency,
        "config": {
            "methods": methods,
            "levels": levels,
            "requests": getattr(args, "requests", None),
            "max_new_tokens": request.stopping.max_new_tokens,
            "temperature": request.sampling.temperature,
            "seed": request.seed,
            "ignore_eos": request.stopping.ignore_eos,
            "num_prompts": len(prompts),
        },
        "machine": machine_info(settings),
    }
    print(format_concurrency(concurrency))
    _write_outputs(args, result, lambda p: plot_concurrency(concurrency, p))
    return 0


def _run_session_workload(
    args: argparse.Namespace,
    engine: Any,
    prompts_path: Path,
    methods: list[str],
    request: GenerationRequest,
    settings: EngineSettings,
) -> int:
    from specserve.bench import sessions
    from specserve.bench.machine import machine_info

    # transformers' and llama.cpp's methods keep nothing across requests here: nothing to compare.
    kept = [m for m in methods if not m.startswith(("hf", "llama.cpp"))]
    if not kept:
        raise InvalidArgument("--workload needs a specserve method (target, glide-cape, remote:...)")
    client = None
    if any(m.startswith(sessions.REMOTE_PREFIX) for m in kept):
        if not getattr(args, "remote", None):
            raise InvalidArgument("remote:<method> needs --remote HOST:PORT")
        from specserve.client import Client

        client = Client(args.remote)
    if args.workload == "multi-turn":
        scripts = sessions.multi_turn_scripts(prompts_path, args.limit)
    else:
        scripts = sessions.doc_qa_scripts(engine.tokenizer, args.limit, args.workload == "doc-chat")
    modes = sessions.CACHE_MODES[args.prefix_cache]
    budget = settings.prefix_cache_bytes or DEFAULT_PREFIX_CACHE_BYTES
    results = sessions.run_session_workload(engine, scripts, kept, request, modes, budget, client)
    result = {
        "workload": args.workload,
        "results": results,
        "config": {
            "methods": kept,
            # remote:<method> runs with the stack target's own cache (its SPECSERVE_TARGET_PREFIX_CACHE_BYTES)
            "prefix_cache": list(modes)
            if any(not m.startswith(sessions.REMOTE_PREFIX) for m in kept)
            else [],
            "prefix_cache_bytes": budget,
            "max_new_tokens": request.stopping.max_new_tokens,
            "temperature": request.sampling.temperature,
            "seed": request.seed,
            "num_scripts": len(scripts),
            "remote": getattr(args, "remote", None),
        },
        "machine": machine_info(settings),
    }
    print(sessions.format_sessions(results))
    _write_outputs(args, result, lambda p: None)
    return 0


def _write_outputs(args: argparse.Namespace, result: dict, plotter: Callable[[Path], None]) -> None:
    if args.out is not None:
        # Written before the plot, so a plotting failure cannot lose the measurements.
        _write(args.out, lambda p: p.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8"))
        print(f"wrote {args.out}")
    if args.plot is not None:
        _write(args.plot, plotter)
        print(f"wrote {args.plot}")


def _check_writable(path: Path) -> None:
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise InvalidArgument(f"output path {path} is a directory")
    if not parent.is_dir():
        raise InvalidArgument(f"output directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise InvalidArgument(f"output path {path} is not writable")


def _write(path: Path, writer: Callable[[Path], object]) -> None:
    try:
        writer(path)
    except OSError as e:
        raise InvalidArgument(f"cannot write {path}: {e.strerror or e}") from None
