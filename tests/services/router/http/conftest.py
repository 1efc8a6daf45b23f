"""A second router process with the HTTP API on, in front of the shared stack's target, draft and Redis
(a router has no model, so it starts in about a second; the stack's models load once per session).

Its limits are small so that tests can reach them: 2 concurrent generations, 64 KiB request bodies. It
asks for a bearer token, as a public deployment would.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from specserve.serving.stack import LocalStack, free_port, wait_serving

MAX_CONCURRENT = 2
MAX_BODY_BYTES = 65536
TOKEN = "http-api-test-token"


@dataclass(frozen=True)
class HttpRouter:
    grpc_address: str
    base_url: str  # the API's root, ".../v1"
    page_url: str  # the playground
    stack: LocalStack
    max_concurrent: int = MAX_CONCURRENT
    max_body_bytes: int = MAX_BODY_BYTES
    token: str = TOKEN


@contextmanager
def router_process(env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    """`specserve serve router` as its own process, until SERVING; stopped (drained) at the end."""
    process = subprocess.Popen(
        [sys.executable, "-m", "specserve.cli", "serve", "router"],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        wait_serving(f"localhost:{env['SPECSERVE_ROUTER_PORT']}", 60, process, log)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def router_env(stack: LocalStack, **settings: object) -> dict[str, str]:
    """The stack's router environment on fresh gRPC and HTTP ports, plus SPECSERVE_ROUTER_<NAME> settings."""
    env = stack.role_env("router") | {"SPECSERVE_ROUTER_PORT": str(free_port())}
    env["SPECSERVE_ROUTER_HTTP_PORT"] = str(free_port())
    return env | {f"SPECSERVE_ROUTER_{name.upper()}": str(value) for name, value in settings.items()}


@pytest.fixture(scope="session")
def http_router(shared_stack: LocalStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpRouter]:
    env = router_env(
        shared_stack,
        max_concurrent_rpcs=MAX_CONCURRENT,
        http_max_body_bytes=MAX_BODY_BYTES,
        auth_tokens=TOKEN,
    )
    http_port = env["SPECSERVE_ROUTER_HTTP_PORT"]
    with router_process(env, tmp_path_factory.mktemp("http-router") / "router.log"):
        yield HttpRouter(
            f"localhost:{env['SPECSERVE_ROUTER_PORT']}",
            f"http://localhost:{http_port}/v1",
            f"http://localhost:{http_port}/",
            shared_stack,
        )


@pytest.fixture
def lone_router(shared_stack: LocalStack, tmp_path: Path) -> Iterator[str]:
    """A router with the HTTP API whose target address has nothing behind it; yields the API's URL."""
    env = router_env(shared_stack, target_addresses=f"localhost:{free_port()}")
    with router_process(env, tmp_path / "router.log"):
        yield f"http://localhost:{env['SPECSERVE_ROUTER_HTTP_PORT']}/v1"


@pytest.fixture
def own_router(shared_stack: LocalStack, tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """A router of the test's own in front of the shared stack (it may stop it); yields (API URL, process)."""
    env = router_env(shared_stack, drain_seconds=20)
    with router_process(env, tmp_path / "router.log") as process:
        yield f"http://localhost:{env['SPECSERVE_ROUTER_HTTP_PORT']}/v1", process
