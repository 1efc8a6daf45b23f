"""One local stack for the whole test session: a real Redis and the target, draft and router services as
processes on the default model (each loads SmolLM2 in ~10 s, so they start once).

Tests that use `shared_stack` are marked `distributed`. They must leave it as they found it: release the
sessions they open and never kill its processes (tests that kill processes start their own stack).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from pinned_costs import pinned_env
from stack_metrics import free_metrics_ports, metrics_env

from specserve.serving.stack import LocalStack

RPC_TIMEOUT_SECONDS = 60.0


@pytest.fixture(scope="session")
def shared_stack(tmp_path_factory: pytest.TempPathFactory, pinned_costs: Path) -> Iterator[LocalStack]:
    # Trees prepared ahead (off by default) so that tests/services/draft can check them; trees priced
    # from the suite's cost record, as the in-process default_engine prices them.
    metrics = free_metrics_ports(("draft",))  # read through stack_metrics.metric
    env = {"SPECSERVE_DRAFT_PREPARE_AHEAD": "true", **pinned_env(pinned_costs), **metrics_env(metrics)}
    with LocalStack(log_dir=tmp_path_factory.mktemp("shared-stack-logs"), env=env) as stack:
        stack.metrics_ports = metrics
        yield stack


@pytest.fixture(scope="session")
def channels(shared_stack: LocalStack) -> Iterator[dict[str, grpc.Channel]]:
    """Plain channels to each service of the shared stack, by role."""
    opened = {role: grpc.insecure_channel(shared_stack.address(role)) for role in shared_stack.roles}
    yield opened
    for channel in opened.values():
        channel.close()


def rpc_error(call: Callable[..., Any], request: Any, **kwargs: Any) -> grpc.RpcError:
    """Makes the call (draining a server stream) and returns the error it must fail with."""
    try:
        response = call(request, timeout=RPC_TIMEOUT_SECONDS, **kwargs)
        if not hasattr(response, "ByteSize"):  # a server stream: errors arrive while iterating
            list(response)
    except grpc.RpcError as error:
        return error
    raise AssertionError(f"{request!r} succeeded; expected an error")


@pytest.fixture
def expect_status() -> Callable[..., str]:
    """expect_status(code, stub.Method, request): asserts the call fails with `code`; returns details."""

    def check(code: grpc.StatusCode, call: Callable[..., Any], request: Any, **kwargs: Any) -> str:
        error = rpc_error(call, request, **kwargs)
        assert error.code() == code, f"got {error.code()}: {error.details()}"
        return error.details()

    return check
