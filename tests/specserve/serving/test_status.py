"""specserve's errors and gRPC status codes: a failed call comes back as the matching error, and a
cancelled call as the one Cancelled, which reads UNAVAILABLE when passed on."""

from __future__ import annotations

import grpc
import pytest

from services.router.http.errors import from_specserve
from specserve.errors import Cancelled, NotFound, StatusCode, Unavailable
from specserve.serving.status import TO_GRPC, error_from_rpc


def failed(code: grpc.StatusCode, details: str = "details") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize(
    ("code", "error_type"),
    [(grpc.StatusCode.NOT_FOUND, NotFound), (grpc.StatusCode.UNAVAILABLE, Unavailable)],
)
def test_a_failed_call_is_the_matching_error(code: grpc.StatusCode, error_type: type) -> None:
    error = error_from_rpc(failed(code), "target t Verify")
    assert type(error) is error_type
    assert str(error) == "target t Verify: details"


def test_a_cancelled_call_is_cancelled_and_passed_on_as_unavailable() -> None:
    """A server that stops cancels its calls: its callers' callers see UNAVAILABLE, and retry."""
    error = error_from_rpc(failed(grpc.StatusCode.CANCELLED), "target t GetModelInfo")
    assert isinstance(error, Cancelled)
    assert str(error) == "target t GetModelInfo: cancelled"
    assert TO_GRPC[error.code] is grpc.StatusCode.UNAVAILABLE
    assert from_specserve(error).status == 503


def test_work_cancelled_by_its_own_caller_is_cancelled() -> None:
    assert Cancelled("the request was cancelled").code is StatusCode.CANCELLED
    assert TO_GRPC[Cancelled().code] is grpc.StatusCode.CANCELLED
