"""A second router process with the HTTP API on, in front of the shared stack's target, draft and Redis
(a router has no model, so it starts in about a second; the stack's models load once per session).

Its limits are small so that tests can reach them: 2 concurrent generations, 64 KiB request bodies. It
asks for a bearer token, as a public deployment would.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

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


@pytest.fixture(scope="session")
def http_router(shared_stack: LocalStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpRouter]:
    port, http_port = free_port(), free_port()
    env = shared_stack.role_env("router") | {
        "SPECSERVE_ROUTER_PORT": str(port),
        "SPECSERVE_ROUTER_HTTP_PORT": str(http_port),
        "SPECSERVE_ROUTER_MAX_CONCURRENT_RPCS": str(MAX_CONCURRENT),
        "SPECSERVE_ROUTER_HTTP_MAX_BODY_BYTES": str(MAX_BODY_BYTES),
        "SPECSERVE_ROUTER_AUTH_TOKENS": TOKEN,
    }
    log = tmp_path_factory.mktemp("http-router") / "router.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "specserve.cli", "serve", "router"],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        wait_serving(f"localhost:{port}", 60, process, log)
        yield HttpRouter(
            f"localhost:{port}",
            f"http://localhost:{http_port}/v1",
            f"http://localhost:{http_port}/",
            shared_stack,
        )
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
