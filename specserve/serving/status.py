"""The one place where specserve's errors meet gRPC status codes, in both directions.

Servers: `ErrorInterceptor` turns a raised `SpecserveError` into its status code and message (anything
else becomes INTERNAL with the exception logged, never a crash of the server), and a request that does
not decode as its message type into INVALID_ARGUMENT; every message is bounded in length. Clients:
`error_from_rpc` turns a `grpc.RpcError` back into the matching `SpecserveError` subclass, so the router
and the SDK handle one typed hierarchy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from specserve.errors import (
    Cancelled,
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
    bounded,
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
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}


def error_from_rpc(error: grpc.RpcError, what: str = "") -> SpecserveError:
    """The SpecserveError for a failed call; `what` names the call in the message."""
    # grpc.Call for the sync API; grpc.aio.AioRpcError (not a grpc.Call) for asyncio.
    is_call = isinstance(error, grpc.Call | grpc.aio.AioRpcError)
    code = error.code() if is_call else grpc.StatusCode.UNKNOWN
    details = error.details() if is_call else str(error)
    if code is grpc.StatusCode.CANCELLED:
        # A Cancelled like the one this process's own caller causes (the router ends the session as
        # cancelled), but passed on to that caller it reads UNAVAILABLE: a server that stops cancels its
        # calls, and clients retry UNAVAILABLE.
        return Cancelled(f"{what}: cancelled" if what else "cancelled", code=StatusCode.UNAVAILABLE)
    cls = _FROM_GRPC.get(code, SpecserveError)
    return cls(f"{what}: {details}" if what else str(details))


def _abort(context: grpc.ServicerContext, error: Exception) -> None:
    if context.code() not in (None, grpc.StatusCode.OK):  # the handler aborted with its own status
        raise error
    if isinstance(error, SpecserveError):
        context.abort(TO_GRPC[error.code], bounded(str(error)))
    logger.exception("unexpected error in an RPC handler")
    context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}")


@contextmanager
def _errors_as_status(context: grpc.ServicerContext) -> Iterator[None]:
    try:
        yield
    except Exception as e:
        _abort(context, e)


@dataclass(frozen=True)
class Undecodable:
    """What a request that does not parse as its message type (invalid UTF-8 in a string field, a
    truncated message, a wire type that does not exist) deserializes to. grpc parses a request before any
    interceptor or handler sees it and answers a parse that raises with INTERNAL; a parse that returns this
    marker instead lets `ErrorInterceptor` answer INVALID_ARGUMENT, without calling the handler."""

    reason: str


def _lenient(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as e:
            return Undecodable(str(e))

    return deserialize


def _refuse(request: Any, context: grpc.ServicerContext) -> Any:
    if isinstance(request, Undecodable):  # the reason names the message type and what was wrong
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, bounded(f"the request could not be decoded: {request.reason}")
        )
    return request


def _refused(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
    for request in requests:
        yield _refuse(request, context)


def refuse_undecodable(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler` with a request parser that never raises, and INVALID_ARGUMENT for what it could not
    parse: unary and streamed requests alike (reflection streams its requests)."""
    parse, serialize = handler.request_deserializer, handler.response_serializer
    if parse is None:
        return handler
    lenient = _lenient(parse)
    if handler.unary_unary:
        unary_unary = handler.unary_unary
        return grpc.unary_unary_rpc_method_handler(
            lambda request, context: unary_unary(_refuse(request, context), context), lenient, serialize
        )
    if handler.unary_stream:
        unary_stream = handler.unary_stream
        return grpc.unary_stream_rpc_method_handler(
            lambda request, context: unary_stream(_refuse(request, context), context), lenient, serialize
        )
    if handler.stream_unary:
        stream_unary = handler.stream_unary
        return grpc.stream_unary_rpc_method_handler(
            lambda requests, context: stream_unary(_refused(requests, context), context), lenient, serialize
        )
    stream_stream = handler.stream_stream
    return grpc.stream_stream_rpc_method_handler(
        lambda requests, context: stream_stream(_refused(requests, context), context), lenient, serialize
    )


class ErrorInterceptor(grpc.ServerInterceptor):
    """Maps exceptions escaping any handler (unary or server-streaming) to status codes, and requests
    that do not decode to INVALID_ARGUMENT (for every service of the server, health and reflection
    included)."""

    def intercept_service(self, continuation: Continuation, details: Any) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None:
            return None
        return refuse_undecodable(within(handler, lambda request, context: _errors_as_status(context)))
