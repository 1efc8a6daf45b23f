"""A second router process with the HTTP API on, in front of the shared stack's target, draft and Redis
(a router has no model, so it starts in about a second; the stack's models load once per session).

Its limits are small so that tests can reach them: 2 concurrent generations, 64 KiB request bodies. It
asks for a bearer token, as a public deployment would.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from router_process import router_env, router_process

from specserve.serving.stack import LocalStack, free_port

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


def http_router_env(stack: LocalStack, **settings: object) -> dict[str, str]:
    """A router environment (see router_process.py) with the HTTP API on a fresh port."""
    return router_env(stack, http_port=free_port(), **settings)


@pytest.fixture(scope="session")
def http_router(shared_stack: LocalStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpRouter]:
    env = http_router_env(
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
    env = http_router_env(shared_stack, target_addresses=f"localhost:{free_port()}")
    with router_process(env, tmp_path / "router.log"):
        yield f"http://localhost:{env['SPECSERVE_ROUTER_HTTP_PORT']}/v1"


@pytest.fixture
def own_router(shared_stack: LocalStack, tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """A router of the test's own in front of the shared stack (it may stop it); yields (API URL, process)."""
    env = http_router_env(shared_stack, drain_seconds=20)
    with router_process(env, tmp_path / "router.log") as process:
        yield f"http://localhost:{env['SPECSERVE_ROUTER_HTTP_PORT']}/v1", process


@pytest.fixture(scope="session")
def open_router(shared_stack: LocalStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A router with the HTTP API as a local deployment runs it: auth off, the default body limit (1 MiB);
    yields the API's host:port."""
    env = http_router_env(shared_stack)
    with router_process(env, tmp_path_factory.mktemp("open-router") / "router.log"):
        yield f"localhost:{env['SPECSERVE_ROUTER_HTTP_PORT']}"
