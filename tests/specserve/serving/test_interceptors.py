"""The server interceptors around a servicer's own handlers, on a real in-process gRPC server (no model):
a raised SpecserveError becomes its status code in unary calls and server streams alike, anything else
INTERNAL; a request that is not its message type gets INVALID_ARGUMENT before any handler runs; error
messages stay short whatever the handler put in them; with tokens on, the handler runs as the caller's
principal in both kinds of call."""

from __future__ import annotations

import grpc
import pytest

from specserve.errors import MAX_MESSAGE_CHARS, InvalidArgument, NotFound
from specserve.serving.auth import current_caller, principal
from specserve.serving.server import start_server
from specserve.serving.settings import RouterServiceSettings
from specserve.v1 import router_pb2, router_pb2_grpc

TOKEN = "interceptor-token"


class Servicer(router_pb2_grpc.RouterServiceServicer):
    def ListMethods(self, request, context):
        if not current_caller():
            raise NotFound("no methods here")
        return router_pb2.ListMethodsResponse(methods=[router_pb2.MethodInfo(name=current_caller())])

    def Cancel(self, request, context):
        raise RuntimeError("a bug")

    def Generate(self, request, context):
        yield router_pb2.GenerateResponse(session_id=current_caller() or "anonymous", token_ids=[1])
        raise InvalidArgument(f"bad prompt {request.prompt!r}")


@pytest.fixture(params=[(), (TOKEN,)], ids=["auth-off", "auth-on"])
def stub(request):
    settings = RouterServiceSettings(host="127.0.0.1", port=0, metrics_port=0, auth_tokens=request.param)
    running = start_server(
        settings,
        lambda server: router_pb2_grpc.add_RouterServiceServicer_to_server(Servicer(), server),
        ("specserve.v1.RouterService",),
    )
    metadata = (("authorization", f"Bearer {TOKEN}"),) if request.param else None
    with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        yield router_pb2_grpc.RouterServiceStub(channel), metadata, channel
    running.stop(0)


def test_errors_become_status_codes_in_unary_calls_and_streams(stub) -> None:
    stub, metadata, _ = stub
    with pytest.raises(grpc.RpcError) as internal:
        stub.Cancel(router_pb2.CancelRequest(session_id="s"), timeout=10, metadata=metadata)
    assert internal.value.code() == grpc.StatusCode.INTERNAL
    assert internal.value.details() == "internal error: RuntimeError"
    stream = stub.Generate(router_pb2.GenerateRequest(prompt="x"), timeout=10, metadata=metadata)
    first = next(stream)  # sent before the handler raised
    assert list(first.token_ids) == [1]
    with pytest.raises(grpc.RpcError) as invalid:
        next(stream)
    assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert invalid.value.details() == "bad prompt 'x'"


def test_the_handler_runs_as_the_caller(stub) -> None:
    stub, metadata, _ = stub
    caller = principal(TOKEN) if metadata else ""
    stream = stub.Generate(router_pb2.GenerateRequest(prompt="x"), timeout=10, metadata=metadata)
    assert next(stream).session_id == (caller or "anonymous")
    if not caller:
        with pytest.raises(grpc.RpcError) as not_found:
            stub.ListMethods(router_pb2.ListMethodsRequest(), timeout=10)
        assert not_found.value.code() == grpc.StatusCode.NOT_FOUND
        assert not_found.value.details() == "no methods here"
    else:
        response = stub.ListMethods(router_pb2.ListMethodsRequest(), timeout=10, metadata=metadata)
        assert [m.name for m in response.methods] == [caller]


@pytest.mark.parametrize(
    "raw",
    [b"\n\x02\xff\xfe", b"z\x05ab", b"\x0f\x00"],
    ids=["invalid-utf8", "truncated", "bad-wire-type"],
)
@pytest.mark.parametrize(
    ("method", "streaming", "message_type"),
    [("Cancel", False, "CancelRequest"), ("Generate", True, "GenerateRequest")],
)
def test_an_undecodable_request_gets_invalid_argument(stub, raw, method, streaming, message_type) -> None:
    _, metadata, channel = stub
    path = f"/specserve.v1.RouterService/{method}"
    call = channel.unary_stream(path) if streaming else channel.unary_unary(path)
    with pytest.raises(grpc.RpcError) as invalid:
        response = call(raw, timeout=10, metadata=metadata)
        if streaming:
            list(response)
    assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = invalid.value.details()
    assert "could not be decoded" in details and f"specserve.v1.{message_type}" in details


def test_error_messages_are_bounded(stub) -> None:
    stub, metadata, _ = stub
    stream = stub.Generate(router_pb2.GenerateRequest(prompt="x" * 1_000_000), timeout=10, metadata=metadata)
    next(stream)
    with pytest.raises(grpc.RpcError) as invalid:
        next(stream)
    assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = invalid.value.details()
    assert details.startswith("bad prompt 'xxx") and details.endswith("xxx'")
    assert len(details) <= MAX_MESSAGE_CHARS
