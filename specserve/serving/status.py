"""The one place where specserve's errors meet gRPC status codes, in both directions.

Servers: `ErrorInterceptor` turns a raised `SpecserveError` into its status code and message (anything
else becomes INTERNAL with the exception logged, never a crash of the server). Clients:
`error_from_rpc` turns a `grpc.RpcError` back into the matching `SpecserveError` subclass, so the router
and the SDK handle one typed hierarchy.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc

from specserve.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    SpecserveError,
    StatusCode,
    Unauthenticated,
    Unavailable,
)
from specserve.serving.handlers import Continuation, within

logger = logging.getLogger(__name__)

TO_GRPC: dict[StatusCode, grpc.StatusCode] = {code: grpc.StatusCode[code.value] for code in StatusCode}

_FROM_GRPC: dict[grpc.StatusCode, type[SpecserveError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.CANCELLED: Unavailable,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}


class Cancelled(SpecserveError):
    """The call was cancelled (by the client, or by the server shutting down)."""

    code = StatusCode.UNAVAILABLE


def error_from_rpc(error: grpc.RpcError, what: str = "") -> SpecserveError:
    """The SpecserveError for a failed call; `what` names the call in the message."""
    # grpc.Call for the sync API; grpc.aio.AioRpcError (not a grpc.Call) for asyncio.
    is_call = isinstance(error, grpc.Call | grpc.aio.AioRpcError)
    code = error.code() if is_call else grpc.StatusCode.UNKNOWN
    details = error.details() if is_call else str(error)
    if code is grpc.StatusCode.CANCELLED:
        return Cancelled(f"{what}: cancelled" if what else "cancelled")
    cls = _FROM_GRPC.get(code, SpecserveError)
    return cls(f"{what}: {details}" if what else str(details))


def _abort(context: grpc.ServicerContext, error: Exception) -> None:
    if context.code() not in (None, grpc.StatusCode.OK):  # the handler aborted with its own status
        raise error
    if isinstance(error, SpecserveError):
        context.abort(TO_GRPC[error.code], str(error))
    logger.exception("unexpected error in an RPC handler")
    context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}")


@contextmanager
def _errors_as_status(context: grpc.ServicerContext) -> Iterator[None]:
    try:
        yield
    except Exception as e:
        _abort(context, e)


class ErrorInterceptor(grpc.ServerInterceptor):
    """Maps exceptions escaping any handler (unary or server-streaming) to status codes."""

    def intercept_service(self, continuation: Continuation, details: Any) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None:
            return None
        return within(handler, lambda request, context: _errors_as_status(context))
