"""Wrapping a gRPC method handler with code that runs around each call (server interceptors)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

Hook = Callable[[Any, grpc.ServicerContext], None]  # (request, context)


def around_calls(
    handler: grpc.RpcMethodHandler, before: Hook, after: Hook | None = None
) -> grpc.RpcMethodHandler:
    """`handler` with `before` run as each unary-request call starts and `after` (if given) as a unary
    call ends, whatever its outcome. Handlers of other kinds are returned as they are."""
    if handler.unary_unary:
        inner_unary = handler.unary_unary

        def unary(request: Any, context: grpc.ServicerContext) -> Any:
            before(request, context)
            try:
                return inner_unary(request, context)
            finally:
                if after is not None:
                    after(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary, handler.request_deserializer, handler.response_serializer
        )
    if handler.unary_stream:
        inner_stream = handler.unary_stream

        def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            before(request, context)
            yield from inner_stream(request, context)

        return grpc.unary_stream_rpc_method_handler(
            stream, handler.request_deserializer, handler.response_serializer
        )
    return handler
