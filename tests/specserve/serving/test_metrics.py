"""Who can read a service's /metrics, on real servers started in-process by `start_server` (no model).

With TLS (certificate, key and CA) the port serves HTTPS with the service's certificate and answers only
scrapers presenting a certificate the service's CA signed: plaintext, no certificate and another CA's
certificate get no metrics, for the router too (whose gRPC callers need no certificate). A connection
that never handshakes does not hold up the others. Without TLS the port listens on loopback only, even
when the service itself listens on every interface, unless `metrics_host` opens it (with a warning).
"""

from __future__ import annotations

import http.client
import logging
import socket
import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from specserve.serving import metrics, tls
from specserve.serving.metrics import CONNECTION_TIMEOUT_SECONDS, TargetMetrics
from specserve.serving.server import RunningServer, start_server
from specserve.serving.settings import RouterServiceSettings, ServerSettings, TargetServiceSettings
from specserve.serving.stack import free_port

METRIC = "specserve:target_sessions"
TIMEOUT = 10.0


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tls.TlsFiles]:
    return tls.make_local_ca(tmp_path_factory.mktemp("ca"), (tls.TARGET_NAME, tls.CLIENT_NAME))


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tls.TlsFiles]:
    return tls.make_local_ca(tmp_path_factory.mktemp("other-ca"), (tls.CLIENT_NAME,))


@contextmanager
def serve(settings: ServerSettings) -> Iterator[RunningServer]:
    """A service with no servicers but a real registry, stopped (its ports closed) at the end."""
    running = start_server(settings, lambda server: None, (), registry=TargetMetrics.create().registry)
    try:
        yield running
    finally:
        running.stop(0)


def tls_settings(kind: type[ServerSettings], files: tls.TlsFiles) -> ServerSettings:
    """A service on loopback with mutual TLS settings and a free metrics port."""
    return kind(
        host="127.0.0.1",
        port=0,
        metrics_port=free_port(),
        tls_cert_file=files.cert_file,
        tls_key_file=files.key_file,
        tls_ca_file=files.ca_file,
    )


@pytest.fixture(params=[TargetServiceSettings, RouterServiceSettings], ids=["target", "router"])
def tls_service(request: pytest.FixtureRequest, ca: dict[str, tls.TlsFiles]) -> Iterator[int]:
    """The target, and the router (whose gRPC callers show no certificate: tls_client_auth is off), with
    TLS; yields the metrics port."""
    settings = tls_settings(request.param, ca[tls.TARGET_NAME])
    with serve(settings):
        yield settings.metrics_port


def scrape(port: int, context: ssl.SSLContext | None = None) -> str:
    """GET /metrics; the response's text (the status must be 200)."""
    if context is None:
        connection: http.client.HTTPConnection = http.client.HTTPConnection(
            "127.0.0.1", port, timeout=TIMEOUT
        )
    else:
        connection = http.client.HTTPSConnection("127.0.0.1", port, timeout=TIMEOUT, context=context)
    try:
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        assert response.status == 200
        return response.read().decode()
    finally:
        connection.close()


def client_context(ca_file: str, client: tls.TlsFiles | None) -> ssl.SSLContext:
    """Verifies the server against `ca_file`; presents `client`'s certificate when given."""
    context = ssl.create_default_context(cafile=ca_file)
    if client is not None:
        context.load_cert_chain(client.cert_file, client.key_file)
    return context


def assert_refused(port: int, context: ssl.SSLContext | None) -> None:
    with pytest.raises(OSError) as refused:
        scrape(port, context)
    # The server refused: not the client failing to verify the server (which would prove nothing).
    assert not isinstance(refused.value, ssl.SSLCertVerificationError), refused.value


def test_with_tls_only_scrapers_with_a_certificate_from_the_ca_read_metrics(
    tls_service: int, ca: dict[str, tls.TlsFiles], other_ca: dict[str, tls.TlsFiles]
) -> None:
    port, ca_file = tls_service, ca[tls.CLIENT_NAME].ca_file
    assert_refused(port, None)  # plaintext HTTP
    assert_refused(port, client_context(ca_file, None))  # TLS, no client certificate
    assert_refused(port, client_context(ca_file, other_ca[tls.CLIENT_NAME]))  # another CA's certificate
    assert METRIC in scrape(port, client_context(ca_file, ca[tls.CLIENT_NAME]))


def test_a_connection_that_never_handshakes_does_not_stall_scrapes(
    ca: dict[str, tls.TlsFiles], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The connections' time limit, shortened from Prometheus's 10 s so the test does not wait it out.
    monkeypatch.setattr(metrics._Handler, "timeout", 0.5)
    settings = tls_settings(TargetServiceSettings, ca[tls.TARGET_NAME])
    context = client_context(ca[tls.CLIENT_NAME].ca_file, ca[tls.CLIENT_NAME])
    with serve(settings), socket.create_connection(("127.0.0.1", settings.metrics_port)) as stalled:
        stalled.settimeout(CONNECTION_TIMEOUT_SECONDS)  # far past the shortened limit
        assert METRIC in scrape(settings.metrics_port, context)  # served beside the stalled connection
        # ... which the server closes once its time is up (recv then reads the end of the stream).
        assert stalled.recv(1) == b""


def listening_hosts(port: int) -> set[str]:
    """The local addresses of the sockets listening on `port` (from the kernel's tables)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, _, state = line.split()[1:4]
            address, local_port = local.rsplit(":", 1)
            if state == "0A" and int(local_port, 16) == port:  # 0A: LISTEN
                packed = bytes.fromhex(address)
                if len(packed) == 4:
                    found.add(socket.inet_ntop(socket.AF_INET, packed[::-1]))
                else:  # four little-endian 32-bit words
                    words = b"".join(packed[i : i + 4][::-1] for i in range(0, 16, 4))
                    found.add(socket.inet_ntop(socket.AF_INET6, words))
    return found


def test_without_tls_metrics_listen_on_loopback_only(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    settings = TargetServiceSettings(host="0.0.0.0", port=0, metrics_port=port)  # the service: everywhere
    with caplog.at_level(logging.WARNING, logger="specserve.serving.metrics"), serve(settings):
        assert listening_hosts(port) == {"127.0.0.1"}
        assert METRIC in scrape(port)
    assert not [record for record in caplog.records if record.name == "specserve.serving.metrics"]
    with pytest.raises(ConnectionRefusedError):  # stopping the service closed the port
        socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)


def test_metrics_host_opens_plaintext_metrics_wider_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    environ = {"SPECSERVE_TARGET_METRICS_HOST": "0.0.0.0"}
    settings = TargetServiceSettings.from_env(environ, host="127.0.0.1", port=0, metrics_port=port)
    with caplog.at_level(logging.WARNING, logger="specserve.serving.metrics"), serve(settings):
        assert listening_hosts(port) == {"0.0.0.0"}
        assert METRIC in scrape(port)
    (warning,) = [record for record in caplog.records if record.name == "specserve.serving.metrics"]
    assert f"serving /metrics on 0.0.0.0:{port} to anyone who reaches it" in warning.getMessage()
