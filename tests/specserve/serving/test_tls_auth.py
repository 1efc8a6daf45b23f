"""TLS, peer names and bearer tokens on real gRPC servers started in-process (no model: the generated
RouterService base answers UNIMPLEMENTED, so any other status is the security layer's)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specserve.client import AsyncClient
from specserve.errors import SpecserveError
from specserve.serving import tls
from specserve.serving.auth import FILE_CHECK_SECONDS, BearerTokenASGI, TokenSet, current_caller, principal
from specserve.serving.server import start_server
from specserve.serving.settings import RouterServiceSettings, TargetServiceSettings
from specserve.serving.stack import free_port
from specserve.v1 import router_pb2, router_pb2_grpc

SERVICE = "specserve.v1.RouterService"


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tls.TlsFiles]:
    return tls.make_local_ca(
        tmp_path_factory.mktemp("ca"), (tls.ROUTER_NAME, tls.DRAFT_NAME, tls.CLIENT_NAME)
    )


def serve(settings):
    return start_server(
        settings,
        lambda server: router_pb2_grpc.add_RouterServiceServicer_to_server(
            router_pb2_grpc.RouterServiceServicer(), server
        ),
        (SERVICE,),
    )


def tls_settings(files: tls.TlsFiles, kind: type = RouterServiceSettings, **fields: object):
    """Settings of a server on a free loopback port that presents `files`' certificate."""
    return kind(
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        tls_cert_file=files.cert_file,
        tls_key_file=files.key_file,
        **fields,
    )


def credentials(files: tls.TlsFiles, with_cert: bool = True) -> grpc.ChannelCredentials:
    read = lambda path: Path(path).read_bytes()  # noqa: E731
    if not with_cert:
        return grpc.ssl_channel_credentials(read(files.ca_file))
    return grpc.ssl_channel_credentials(read(files.ca_file), read(files.key_file), read(files.cert_file))


def list_methods_status(channel: grpc.Channel, token: str | None = None) -> grpc.StatusCode:
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    try:
        router_pb2_grpc.RouterServiceStub(channel).ListMethods(
            router_pb2.ListMethodsRequest(), timeout=10, metadata=metadata
        )
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_mutual_tls_admits_only_allowed_certificate_names_and_probes_use_the_health_port(ca) -> None:
    files = ca[tls.ROUTER_NAME]
    health_port = free_port()
    settings = tls_settings(
        files,
        TargetServiceSettings,
        tls_ca_file=files.ca_file,
        tls_allowed_clients=(tls.ROUTER_NAME,),
        health_port=health_port,
    )
    running = serve(settings)
    address = f"localhost:{running.port}"
    try:
        with grpc.secure_channel(address, credentials(ca[tls.ROUTER_NAME])) as channel:
            assert list_methods_status(channel) == grpc.StatusCode.UNIMPLEMENTED  # got through
        with grpc.secure_channel(address, credentials(ca[tls.CLIENT_NAME])) as channel:
            assert list_methods_status(channel) == grpc.StatusCode.PERMISSION_DENIED  # same CA, wrong name
        with grpc.secure_channel(address, credentials(ca[tls.CLIENT_NAME], with_cert=False)) as channel:
            assert list_methods_status(channel) == grpc.StatusCode.UNAVAILABLE  # no client certificate
        with grpc.insecure_channel(address) as channel:
            assert list_methods_status(channel) == grpc.StatusCode.UNAVAILABLE  # plaintext
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            assert list_methods_status(channel) == grpc.StatusCode.UNIMPLEMENTED  # health only, no API
    finally:
        running.stop(0)


def test_bearer_tokens_from_a_list_and_a_rotated_file(ca, tmp_path: Path) -> None:
    token_file = tmp_path / "tokens"
    token_file.write_text("# one per line\nfrom-file-1\n")
    running = serve(
        tls_settings(ca[tls.ROUTER_NAME], auth_tokens=("listed",), auth_token_file=str(token_file))
    )
    try:
        # TLS without client certificates (the router's public side), tokens decide.
        with grpc.secure_channel(
            f"localhost:{running.port}", credentials(ca[tls.CLIENT_NAME], False)
        ) as channel:
            assert list_methods_status(channel) == grpc.StatusCode.UNAUTHENTICATED
            assert list_methods_status(channel, "wrong") == grpc.StatusCode.UNAUTHENTICATED
            assert list_methods_status(channel, "listed") == grpc.StatusCode.UNIMPLEMENTED
            assert list_methods_status(channel, "from-file-1") == grpc.StatusCode.UNIMPLEMENTED
            token_file.write_text("from-file-2\n")  # rotation: no restart
            time.sleep(FILE_CHECK_SECONDS + 0.2)
            assert list_methods_status(channel, "from-file-1") == grpc.StatusCode.UNAUTHENTICATED
            assert list_methods_status(channel, "from-file-2") == grpc.StatusCode.UNIMPLEMENTED
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token
    finally:
        running.stop(0)


def test_a_missing_token_file_accepts_no_file_token(tmp_path: Path) -> None:
    tokens = TokenSet(("a",), str(tmp_path / "absent"))
    assert tokens.accepts("a") and not tokens.accepts("") and not tokens.accepts("b")


def test_replicas_dialled_by_ip_are_verified_against_the_configured_name(ca) -> None:
    running = serve(tls_settings(ca[tls.ROUTER_NAME]))  # issued for specserve-router, localhost, 127.0.0.1
    client = ca[tls.CLIENT_NAME]
    client_settings = RouterServiceSettings(
        tls_cert_file=client.cert_file, tls_key_file=client.key_file, tls_ca_file=client.ca_file
    )
    try:
        for name, expected in [
            (tls.ROUTER_NAME, grpc.StatusCode.UNIMPLEMENTED),
            ("specserve-other", grpc.StatusCode.UNAVAILABLE),
        ]:
            with tls.open_channel(
                f"127.0.0.1:{running.port}", client_settings, [], server_name=name
            ) as channel:
                assert list_methods_status(channel, None) == expected, name
    finally:
        running.stop(0)


def call_asgi(app, path: str, authorization: str | None) -> tuple[int, bytes]:
    """One HTTP request through an ASGI app, as a server would make it."""
    headers = [(b"authorization", authorization.encode())] if authorization else []
    scope = {"type": "http", "method": "GET", "path": path, "headers": headers}
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


async def whoami(scope, receive, send) -> None:
    """An ASGI app answering with the caller's principal (what a session created here would store)."""
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": current_caller().encode()})


def test_the_http_api_takes_the_same_tokens_as_openai_api_keys() -> None:
    app = BearerTokenASGI(whoami, TokenSet(("key-1",)))
    status, body = call_asgi(app, "/v1/models", None)
    assert status == 401
    assert json.loads(body) == {
        "error": {
            "message": "missing or invalid credentials",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    assert call_asgi(app, "/v1/models", "Bearer key-2")[0] == 401
    assert call_asgi(app, "/v1/models", "Bearer key-1") == (200, principal("key-1").encode())
    assert call_asgi(app, "/health", None) == (200, b"")  # probes need no key
    assert call_asgi(BearerTokenASGI(whoami, TokenSet()), "/v1/models", None) == (200, b"")  # auth off


def test_plaintext_off_loopback_is_served_with_a_warning(caplog) -> None:
    with caplog.at_level("WARNING", logger="specserve.serving.server"):
        running = serve(RouterServiceSettings(host="0.0.0.0", port=0, metrics_port=0))
        running.stop(0)
        loopback = serve(RouterServiceSettings(host="127.0.0.1", port=0, metrics_port=0))
        loopback.stop(0)
    warnings = [r.getMessage() for r in caplog.records if "PLAINTEXT" in r.getMessage()]
    assert len(warnings) == 1 and "0.0.0.0" in warnings[0] and "tls_cert_file" in warnings[0]


def test_the_asyncio_client_sends_its_token_over_tls(ca) -> None:
    files = ca[tls.ROUTER_NAME]
    running = serve(tls_settings(files, auth_tokens=("async-token",)))

    async def cancel_status(token: str | None) -> str:
        async with AsyncClient(f"localhost:{running.port}", token=token, tls_ca_file=files.ca_file) as client:
            try:
                await client.cancel("some-session")
            except SpecserveError as e:
                return type(e).__name__ + ": " + str(e)
        return "ok"

    try:
        assert asyncio.run(cancel_status(None)) == "Unauthenticated: missing or invalid credentials"
        assert asyncio.run(cancel_status("async-token")).startswith("SpecserveError")  # UNIMPLEMENTED here
    finally:
        running.stop(0)
