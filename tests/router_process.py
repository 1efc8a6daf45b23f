"""A router of a test's own, as a process in front of the shared stack's target, draft and Redis (a
router has no model, so it starts in about a second)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from specserve.serving.stack import LocalStack, free_port, wait_serving


def router_env(stack: LocalStack, **settings: object) -> dict[str, str]:
    """The stack's router environment on a fresh gRPC port, plus SPECSERVE_ROUTER_<NAME> settings."""
    env = stack.role_env("router") | {"SPECSERVE_ROUTER_PORT": str(free_port())}
    return env | {f"SPECSERVE_ROUTER_{name.upper()}": str(value) for name, value in settings.items()}


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
