"""`specserve serve ROLE` (one service process) and `specserve stack` (the whole local stack).

`specserve stack` is secure by default, since it serves on ports every local user can reach: mutual TLS
between the services from a fresh local CA, TLS to the router, and a bearer token at the router (a
random one unless given). Tokens come from a file or the environment; `--token` still works but puts
the token on the command line, which every local user can read. `--insecure` is plaintext without a
token, and says so on stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specserve.app.model_args import add_model_option
from specserve.catalog import DEFAULT_METHOD
from specserve.runtime.measuring import starting_up
from specserve.serving.auth import read_token_file
from specserve.serving.private_files import readable_by_others
from specserve.serving.server import RunningServer, serve_until_signal
from specserve.serving.settings import DraftServiceSettings, RouterServiceSettings, TargetServiceSettings
from specserve.serving.telemetry import configure_tracing, shutdown_tracing
from specserve.settings import EngineSettings, default_cache_dir

if TYPE_CHECKING:
    from specserve.serving.stack import LocalStack

ROLES = ("target", "draft", "router")
STACK_TOKEN_ENV = "SPECSERVE_STACK_TOKEN"  # comma-separated tokens for `specserve stack`
GENERATED_TOKEN_BYTES = 32


def add_serve_parsers(subparsers: Any) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="run one gRPC service (target, draft or router)",
        description="Settings come from SPECSERVE_<ROLE>_* variables (and SPECSERVE_* for the model); "
        "flags override them. Tracing follows the standard OTEL_* variables.",
    )
    serve.add_argument("role", choices=ROLES)
    add_model_option(serve)  # target and draft; the router loads no model
    serve.add_argument("--port", type=int, help="gRPC port")
    serve.add_argument("--metrics-port", type=int, help="Prometheus port (0 = off)")
    serve.add_argument("--target-addresses", help="router: comma-separated target host:port list")
    serve.add_argument("--draft-addresses", help="router: comma-separated draft host:port list")
    serve.add_argument(
        "--redis-url",
        help="router: redis://host:port/db; a URL with a password belongs in SPECSERVE_ROUTER_REDIS_URL, "
        "since every local user can read a command line",
    )

    stack = subparsers.add_parser(
        "stack",
        help="run the local stack (Redis, target, draft, router) and stream a generation through it",
        description="Starts a real Redis, the target, draft and router services as processes, waits "
        "until each reports SERVING, streams one generation through the client SDK, then keeps "
        "serving until Ctrl-C (or exits with --once). Everything is stopped cleanly. By default the "
        "services talk mutual TLS from a fresh local CA and the router wants a bearer token: a random "
        f"one unless --token-file or ${STACK_TOKEN_ENV} gives one; the stack prints where it is.",
    )
    stack.add_argument(
        "prompt", nargs="?", default="Explain in three sentences what speculative decoding is."
    )
    stack.add_argument(
        "--method", help=f"the demo's method (default: the model's own; {DEFAULT_METHOD} for the default)"
    )
    add_model_option(stack)
    stack.add_argument("--max-new-tokens", type=int, default=128)
    stack.add_argument("--once", action="store_true", help="stop the stack after the generation")
    stack.add_argument(
        "--base-port",
        type=int,
        default=0,
        help="router port; target, draft and Redis follow, then any further target replicas (0 = free ports)",
    )
    stack.add_argument(
        "--target-replicas",
        type=int,
        default=1,
        help="target processes (each loads the model); the router places sessions among them, by the "
        "longest cached prompt prefix, else by load",
    )
    mode = stack.add_mutually_exclusive_group()
    mode.add_argument(
        "--tls",
        action="store_true",
        help="mutual TLS between the services and TLS to the router, from a fresh local CA (the default)",
    )
    mode.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext between the services and to the router, and no token unless one is given: any "
        "local user can call every service",
    )
    stack.add_argument(
        "--token-file",
        type=Path,
        help="require the bearer tokens in this file at the router (one per line, mode 0600); the demo "
        f"uses the first. ${STACK_TOKEN_ENV} (comma-separated) adds tokens too",
    )
    stack.add_argument(
        "--token",
        action="append",
        default=[],
        help="require this bearer token at the router (repeatable); visible to every local user (ps): "
        "prefer --token-file",
    )
    stack.add_argument(
        "--log-dir",
        type=Path,
        help="keep the logs, Redis's data, the CA and the token file here, made private (mode 0700, files "
        "0600; default: a private temporary directory, removed when the stack stops)",
    )
    stack.add_argument(
        "--http-port",
        type=int,
        help="serve the OpenAI-compatible HTTP API and the playground page on this port (0 = a free one)",
    )


# libgomp's spin-wait before an idle OpenMP worker sleeps, for the target and draft processes (read when
# torch loads, so set before it is imported; an explicit GOMP_SPINCOUNT wins). A forward is hundreds of
# parallel regions, each ending at a barrier. A worker that spins there keeps its core while the thread it
# waits for may be the one without a core: whenever anything else runs on the machine (the other model
# service, the router, any other process), every barrier then waits for the scheduler, and the forward
# takes many times longer. That was the stack's slow mode, steady for as long as the cores stayed shared:
# on 2 cores, a one-token completion took 0.33 s at 30,000 spins (libgomp's default, 300,000, slower
# still) and 0.06 s at 100; 0.91 s against 0.10 s with one more core kept busy (docs/benchmarks.md, the
# distributed stack). Too few spins cost the idle case instead: a worker that sleeps at once must be woken
# for the next region, and at 100 spins a one-token forward took 45-48 ms against 35 ms on an idle
# machine. 10,000 spins (a few hundred microseconds) are as fast as libgomp's default when the cores are
# free (35.3 ms) and keep the slow mode away when they are not (139 ms with three busy processes, against
# 107 ms at 100 spins and 337 ms at the default): docs/benchmarks.md, "Cores shared with other work".
SERVICE_GOMP_SPINCOUNT = "10000"


def run_serve(args: argparse.Namespace) -> int:
    logging.getLogger().setLevel(logging.INFO)
    if args.role != "router":
        os.environ.setdefault("GOMP_SPINCOUNT", SERVICE_GOMP_SPINCOUNT)
    configure_tracing(args.role)
    try:
        # Started side by side with the stack's other services, each holds the host's measuring lock
        # shared until it serves: a cost measurement waits for every start to end (runtime/measuring.py).
        engine_settings = None if args.role == "router" else EngineSettings.from_env(model=args.model)
        cache_dir = default_cache_dir() if engine_settings is None else engine_settings.cache_dir
        with starting_up(cache_dir):
            running = _start_role(args, engine_settings)
        serve_until_signal(running)
    finally:
        shutdown_tracing()
    return 0


def _start_role(args: argparse.Namespace, engine_settings: EngineSettings | None) -> RunningServer:
    common = {"port": args.port, "metrics_port": args.metrics_port}
    if engine_settings is None:  # the router: no model, no torch in this process
        from services.router.main import start_router

        split = lambda v: None if v is None else tuple(a for a in v.split(",") if a)  # noqa: E731
        settings = RouterServiceSettings.from_env(
            **common,
            target_addresses=split(args.target_addresses),
            draft_addresses=split(args.draft_addresses),
            redis_url=args.redis_url,
        )
        return start_router(settings)
    if args.role == "target":
        from services.target.main import start_target

        running = start_target(TargetServiceSettings.from_env(**common), engine_settings)
    else:
        from services.draft.main import start_draft

        running = start_draft(DraftServiceSettings.from_env(**common), engine_settings)
    from specserve.runtime.target_runtime import settle_heap

    settle_heap()  # loaded and warmed up: what is alive now lives as long as the process
    return running


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


@dataclass(frozen=True)
class StackSecurity:
    """What `specserve stack` runs with: TLS (mutual between the services) and the router's tokens."""

    tls: bool
    tokens: tuple[str, ...]
    generated: bool = False  # the token was made up for this run


def _warn(message: str) -> None:
    print(f"specserve stack: warning: {message}", file=sys.stderr, flush=True)


def given_tokens(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[str, ...]:
    """--token, then --token-file, then $SPECSERVE_STACK_TOKEN; warns where a token is exposed."""
    if args.token:
        _warn(
            "--token puts the token on this command line, which every local user can read (ps); "
            f"use --token-file (mode 0600) or ${STACK_TOKEN_ENV}"
        )
    tokens = list(args.token)
    if args.token_file is not None:
        tokens += read_token_file(args.token_file)
        if readable_by_others(args.token_file):
            _warn(f"{args.token_file} is readable by other users: chmod 600 it")
    tokens += [t.strip() for t in environ.get(STACK_TOKEN_ENV, "").split(",") if t.strip()]
    return tuple(tokens)


def stack_security(args: argparse.Namespace, environ: Mapping[str, str]) -> StackSecurity:
    """TLS and a token unless --insecure; a random token when none is given."""
    tokens = given_tokens(args, environ)
    if args.insecure:
        _warn(
            "--insecure: PLAINTEXT between the services and to the router"
            + ("" if tokens else ", and no token")
            + ": every local user can call the router, the target and the draft"
        )
        return StackSecurity(tls=False, tokens=tokens)
    if tokens:
        return StackSecurity(tls=True, tokens=tokens)
    return StackSecurity(tls=True, tokens=(secrets.token_urlsafe(GENERATED_TOKEN_BYTES),), generated=True)


def how_to_call(stack: LocalStack, generated: bool = False) -> list[str]:
    """Commands that call the running stack with its token file and CA (no secret is printed)."""
    ca = stack.client_tls.ca_file if stack.client_tls is not None else ""
    token_file = stack.token_file
    token, lines = "", []
    if token_file is not None:
        first_line = "cat" if len(stack.auth_tokens) == 1 else "head -n1"  # one token per line
        token = f"$({first_line} {token_file})"
        made = " (generated for this run)" if generated else ""
        lines.append(f"  API token{made}, readable by you only: {token_file}")
    remote = f"specserve generate --remote {stack.router_address}" + (f" --tls-ca {ca}" if ca else "")
    lines.append(f'  {_env_prefix(SPECSERVE_TOKEN=token)}{remote} "Write a haiku."')
    sdk = [repr(stack.router_address)]
    sdk += [f"token=open({str(token_file)!r}).read().split()[0]"] if token_file is not None else []
    sdk += [f"tls_ca_file={ca!r}"] if ca else []
    lines.append(f"  Python: specserve.client.Client({', '.join(sdk)})")
    if stack.http_url:
        auth = f' -H "Authorization: Bearer {token}"' if token else ""
        lines.append(f"  curl{f' --cacert {ca}' if ca else ''}{auth} {stack.http_url}/models")
        openai_env = _env_prefix(OPENAI_API_KEY=token or "unused", SSL_CERT_FILE=ca)
        lines.append(f"  OpenAI SDK: {openai_env}python app.py, with OpenAI(base_url={stack.http_url!r})")
    return lines


def _env_prefix(**variables: str) -> str:
    """`NAME=value ` for each variable with a value, as a shell command's prefix."""
    return "".join(f"{name}={value} " for name, value in variables.items() if value)


def stack_model_env(model: str | None) -> dict[str, str]:
    """The services' SPECSERVE_MODEL for --model; the profile (and its draft) is checked here, so that a
    missing install fails before any process starts rather than in the target's log."""
    from specserve.models.install import require_installed
    from specserve.models.profiles import model_profile

    settings = EngineSettings.from_env(model=model)  # --model, else SPECSERVE_MODEL
    profile = model_profile(settings.model)
    if settings.model_dir is None:
        for name in filter(None, (profile.name, profile.draft)):
            require_installed(model_profile(name), settings.cache_dir)
    # The router serves the model's own default method to requests that name none (unless told).
    default_method = os.environ.get("SPECSERVE_ROUTER_DEFAULT_METHOD") or profile.default_method
    env = {"SPECSERVE_ROUTER_DEFAULT_METHOD": default_method}
    return env if model is None else {**env, "SPECSERVE_MODEL": model}


def run_stack(args: argparse.Namespace) -> int:
    from specserve.serving.stack import LocalStack, stream_demo

    security = stack_security(args, os.environ)
    model_env = stack_model_env(args.model)
    # `kill`, a container runtime or a CI timeout sends SIGTERM: stop the children as Ctrl-C does instead
    # of leaving Redis and three services orphaned on their ports.
    signal.signal(signal.SIGTERM, _interrupt)
    with LocalStack(
        base_port=args.base_port,
        log_dir=args.log_dir,
        http_port=args.http_port,
        tls=security.tls,
        auth_tokens=security.tokens,
        env=model_env,
        target_replicas=args.target_replicas,
    ) as stack:
        if stack.http_url:
            print(f"OpenAI-compatible API at {stack.http_url}, playground at {stack.playground_url}")
        method = args.method or ""  # "": the router's default, the model's own
        stream_demo(stack.router_address, args.prompt, method, args.max_new_tokens, **stack.client_options())
        if stack.client_tls is not None:
            print(f"\nTLS: clients verify the router with {stack.client_tls.ca_file}", flush=True)
        if not args.once:
            calls = how_to_call(stack, security.generated)
            print("\nCall it while it serves:\n" + "\n".join(calls), flush=True)
            label = "" if security.tls else " INSECURE (plaintext)"
            targets = f", targets at {', '.join(stack.target_addresses)}" if args.target_replicas > 1 else ""
            print(
                f"\nstack serving{label}: router at {stack.router_address}{targets} (Ctrl-C stops it)",
                flush=True,
            )
            stack.wait()
    return 0
