"""Wrapping a gRPC method handler with code that runs around each call (server interceptors)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import grpc

Continuation = Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler]  # of ServerInterceptor
Behaviour = Callable[[Any, grpc.ServicerContext], Any]  # (request, context) -> response, or its stream
Hook = Callable[[Any, grpc.ServicerContext], None]  # (request, context)


def wrap_handler(
    handler: grpc.RpcMethodHandler,
    wrap_unary: Callable[[Behaviour], Behaviour],
    wrap_stream: Callable[[Behaviour], Behaviour],
) -> grpc.RpcMethodHandler:
    """`handler` with its behaviour replaced by `wrap_unary(behaviour)` (a unary call) or
    `wrap_stream(behaviour)` (a server stream). Handlers of other kinds are returned as they are."""
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(
            wrap_unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer
        )
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            wrap_stream(handler.unary_stream), handler.request_deserializer, handler.response_serializer
        )
    return handler


def within(
    handler: grpc.RpcMethodHandler, scope: Callable[[Any, grpc.ServicerContext], AbstractContextManager]
) -> grpc.RpcMethodHandler:
    """`handler` with each call run inside `scope(request, context)`, a context manager entered as the
    call starts and left as it ends (a server stream: when its last response is sent, or it fails)."""

    def wrap_unary(inner: Behaviour) -> Behaviour:
        def unary(request: Any, context: grpc.ServicerContext) -> Any:
            with scope(request, context):
                return inner(request, context)

        return unary

    def wrap_stream(inner: Behaviour) -> Behaviour:
        def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            with scope(request, context):
                yield from inner(request, context)

        return stream

    return wrap_handler(handler, wrap_unary, wrap_stream)


def around_calls(
    handler: grpc.RpcMethodHandler, before: Hook, after: Hook | None = None
) -> grpc.RpcMethodHandler:
    """`handler` with `before` run as each unary-request call starts and `after` (if given) as a unary
    call ends, whatever its outcome. Handlers of other kinds are returned as they are."""

    def wrap_unary(inner: Behaviour) -> Behaviour:
        def unary(request: Any, context: grpc.ServicerContext) -> Any:
            before(request, context)
            try:
                return inner(request, context)
            finally:
                if after is not None:
                    after(request, context)

        return unary

    def wrap_stream(inner: Behaviour) -> Behaviour:
        def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            before(request, context)
            yield from inner(request, context)

        return stream

    return wrap_handler(handler, wrap_unary, wrap_stream)
