"""`specserve serve ROLE` (one service process) and `specserve stack` (the whole local stack)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
from typing import Any

from specserve.catalog import DEFAULT_METHOD
from specserve.serving.server import serve_until_signal
from specserve.serving.settings import DraftServiceSettings, RouterServiceSettings, TargetServiceSettings
from specserve.serving.telemetry import configure_tracing, shutdown_tracing

ROLES = ("target", "draft", "router")


def add_serve_parsers(subparsers: Any) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="run one gRPC service (target, draft or router)",
        description="Settings come from SPECSERVE_<ROLE>_* variables (and SPECSERVE_* for the model); "
        "flags override them. Tracing follows the standard OTEL_* variables.",
    )
    serve.add_argument("role", choices=ROLES)
    serve.add_argument("--port", type=int, help="gRPC port")
    serve.add_argument("--metrics-port", type=int, help="Prometheus port (0 = off)")
    serve.add_argument("--target-addresses", help="router: comma-separated target host:port list")
    serve.add_argument("--draft-addresses", help="router: comma-separated draft host:port list")
    serve.add_argument("--redis-url", help="router: redis://host:port/db")

    stack = subparsers.add_parser(
        "stack",
        help="run the local stack (Redis, target, draft, router) and stream a generation through it",
        description="Starts a real Redis, the target, draft and router services as processes, waits "
        "until each reports SERVING, streams one generation through the client SDK, then keeps "
        "serving until Ctrl-C (or exits with --once). Everything is stopped cleanly.",
    )
    stack.add_argument(
        "prompt", nargs="?", default="Explain in three sentences what speculative decoding is."
    )
    stack.add_argument("--method", default=DEFAULT_METHOD)
    stack.add_argument("--max-new-tokens", type=int, default=128)
    stack.add_argument("--once", action="store_true", help="stop the stack after the generation")
    stack.add_argument(
        "--base-port", type=int, default=0, help="router port; the others follow (0 = free ports)"
    )
    stack.add_argument(
        "--tls",
        action="store_true",
        help="mutual TLS between the services and TLS to the router, from a fresh local CA",
    )
    stack.add_argument(
        "--token",
        action="append",
        default=[],
        help="require this bearer token at the router (repeatable); the demo uses the first",
    )
    stack.add_argument(
        "--http-port",
        type=int,
        help="serve the OpenAI-compatible HTTP API and the playground page on this port (0 = a free one)",
    )


# libgomp's spin-wait before an idle OpenMP worker sleeps, for the target and draft processes (read when
# torch loads, so set before it is imported; an explicit GOMP_SPINCOUNT wins). The default (300,000
# spins, milliseconds) keeps a finished forward's workers burning cores the other service needs next
# on a shared machine; 30,000 still spans the microsecond gaps between one forward's parallel regions.
# Measured on 2 cores: draft handler 16.4 -> 11.5 ms per round (docs/benchmarks.md, the distributed stack).
SERVICE_GOMP_SPINCOUNT = "30000"


def run_serve(args: argparse.Namespace) -> int:
    logging.getLogger().setLevel(logging.INFO)
    if args.role != "router":
        os.environ.setdefault("GOMP_SPINCOUNT", SERVICE_GOMP_SPINCOUNT)
    configure_tracing(args.role)
    common = {"port": args.port, "metrics_port": args.metrics_port}
    try:
        if args.role == "router":  # no torch in this process
            from services.router.main import start_router

            split = lambda v: None if v is None else tuple(a for a in v.split(",") if a)  # noqa: E731
            settings = RouterServiceSettings.from_env(
                **common,
                target_addresses=split(args.target_addresses),
                draft_addresses=split(args.draft_addresses),
                redis_url=args.redis_url,
            )
            running = start_router(settings)
        else:
            from specserve.settings import EngineSettings

            engine_settings = EngineSettings.from_env()
            if args.role == "target":
                from services.target.main import start_target

                running = start_target(TargetServiceSettings.from_env(**common), engine_settings)
            else:
                from services.draft.main import start_draft

                running = start_draft(DraftServiceSettings.from_env(**common), engine_settings)
        serve_until_signal(running)
    finally:
        shutdown_tracing()
    return 0


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def run_stack(args: argparse.Namespace) -> int:
    from specserve.serving.stack import LocalStack, stream_demo

    # `kill`, a container runtime or a CI timeout sends SIGTERM: stop the children as Ctrl-C does instead
    # of leaving Redis and three services orphaned on their ports.
    signal.signal(signal.SIGTERM, _interrupt)
    with LocalStack(
        base_port=args.base_port, http_port=args.http_port, tls=args.tls, auth_tokens=tuple(args.token)
    ) as stack:
        if stack.http_url:
            print(f"OpenAI-compatible API at {stack.http_url}, playground at {stack.playground_url}")
        stream_demo(
            stack.router_address, args.prompt, args.method, args.max_new_tokens, **stack.client_options()
        )
        if stack.client_tls is not None:
            print(f"\nTLS: clients verify the router with {stack.client_tls.ca_file}", flush=True)
        if not args.once:
            print(f"\nstack serving: router at {stack.router_address} (Ctrl-C stops it)", flush=True)
            stack.wait()
    return 0
