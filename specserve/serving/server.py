"""Starting and stopping a service the same way for all three roles.

A sync gRPC server with: bounded concurrency (`maximum_concurrent_rpcs`: the overflow gets
RESOURCE_EXHAUSTED at once, there is no unbounded queue), message size limits both ways, the error
interceptor, trace propagation, grpc.health.v1 and reflection, Prometheus on its own port (HTTPS with
the service's TLS, serving/metrics.py), and a graceful drain on SIGTERM/SIGINT (health turns
NOT_SERVING, new RPCs are refused, running ones get `drain_seconds` to finish). A service that holds
sessions (the target, the draft) also releases those whose lease lapsed or that sat idle, and serves
SessionLeaseService (serving/expiry.py).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from specserve.serving import tls
from specserve.serving.auth import TokenAuthInterceptor, TokenSet
from specserve.serving.expiry import (
    LEASE_SERVICE_NAME,
    ActivityInterceptor,
    SessionExpiry,
    SessionLeaseServicer,
)
from specserve.serving.metrics import serve_metrics
from specserve.serving.settings import ServerSettings
from specserve.serving.status import ErrorInterceptor
from specserve.serving.telemetry import server_interceptors
from specserve.v1 import lease_pb2_grpc

logger = logging.getLogger(__name__)


def channel_options(settings: ServerSettings) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.max_receive_message_length", settings.max_message_bytes),
    ]


@dataclass
class RunningServer:
    server: grpc.Server
    port: int  # the bound port (settings.port 0 = any free port)
    health: health.HealthServicer
    service_names: tuple[str, ...]
    drain_seconds: float
    on_stop: Callable[[], None] | None = None
    on_drain: Callable[[], None] | None = None  # when the drain starts (another listener drains alongside)

    def stop(self, grace: float | None = None) -> None:
        """Drain: NOT_SERVING first (load balancers stop sending), then wait for running RPCs."""
        self.health.enter_graceful_shutdown()
        if self.on_drain is not None:
            self.on_drain()
        self.server.stop(self.drain_seconds if grace is None else grace).wait()
        if self.on_stop is not None:
            self.on_stop()

    def wait(self) -> None:
        self.server.wait_for_termination()


def security_interceptors(settings: ServerSettings) -> list[grpc.ServerInterceptor]:
    """Bearer tokens (the router's auth settings), then which peers may call (mutual TLS settings)."""
    interceptors: list[grpc.ServerInterceptor] = []
    tokens = TokenSet(getattr(settings, "auth_tokens", ()), getattr(settings, "auth_token_file", ""))
    if tokens.enabled:
        interceptors.append(TokenAuthInterceptor(tokens))
    allowed = getattr(settings, "tls_allowed_clients", None)
    if tls.tls_enabled(settings) and settings.tls_ca_file and settings.tls_client_auth and allowed:
        per_method: dict[str, Iterable[str]] = {}
        feed_clients = getattr(settings, "tls_kv_feed_clients", None)  # the target's KV feed
        if feed_clients:
            per_method["StreamKV"] = feed_clients
            # The feed's readers (drafts) size their trees by the costs the target publishes.
            per_method["GetModelInfo"] = (*allowed, *feed_clients)
        interceptors.append(tls.PeerInterceptor(allowed, per_method))
    return interceptors


def start_server(
    settings: ServerSettings,
    add_servicers: Callable[[grpc.Server], None],
    service_names: tuple[str, ...],  # fully qualified, e.g. "specserve.v1.TargetService"
    registry: CollectorRegistry | None = None,
    on_stop: Callable[[], None] | None = None,
    # A service with sessions: they expire by settings.session_lease_seconds and session_idle_seconds
    # (serving/expiry.py), and the service serves SessionLeaseService for the router's renewals.
    release_session: Callable[[str], object] | None = None,
) -> RunningServer:
    expiry = None
    if release_session is not None:
        expiry = SessionExpiry(
            getattr(settings, "session_idle_seconds", 0.0),
            release_session,
            lease_seconds=getattr(settings, "session_lease_seconds", 0.0),
        )
        service_names = (*service_names, LEASE_SERVICE_NAME)
    activity = [ActivityInterceptor(expiry)] if expiry is not None and expiry.enabled else []
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=settings.num_worker_threads),
        interceptors=[
            *server_interceptors(),
            *security_interceptors(settings),
            ErrorInterceptor(),
            *activity,
        ],
        # gRPC binds with SO_REUSEPORT by default: a second server on a busy port would start "fine" and
        # silently take half the connections. A port in use must be an error.
        options=[*channel_options(settings), ("grpc.so_reuseport", 0)],
        maximum_concurrent_rpcs=settings.max_concurrent_rpcs,
    )
    add_servicers(server)
    if expiry is not None:
        lease_pb2_grpc.add_SessionLeaseServiceServicer_to_server(SessionLeaseServicer(expiry), server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if settings.reflection:
        reflection.enable_server_reflection(
            (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
    credentials = tls.server_credentials(settings)
    try:  # grpcio >= 1.60 raises, older ones return 0
        if credentials is None:
            port = server.add_insecure_port(settings.address)
        else:
            port = server.add_secure_port(settings.address, credentials)
    except RuntimeError:
        port = 0
    if port == 0:
        raise OSError(f"cannot bind {settings.address} (is the port in use?)")
    if credentials is None and not tls.is_loopback(settings.host):
        logger.warning(
            "serving PLAINTEXT on %s: anyone on the network can read and send requests; set "
            "tls_cert_file, tls_key_file and tls_ca_file (docs/security.md)",
            settings.address,
        )
    server.start()
    health_only = _start_health_server(settings, health_servicer) if settings.health_port else None
    if health_only is not None:
        main_on_stop = on_stop

        def on_stop() -> None:
            health_only.stop(0)
            if main_on_stop is not None:
                main_on_stop()

    if expiry is not None:
        expiry.start()
        previous_on_stop = on_stop

        def on_stop() -> None:
            expiry.close()
            if previous_on_stop is not None:
                previous_on_stop()

    for name in ("", *service_names):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if registry is not None:
        metrics = serve_metrics(registry, settings)
        if metrics is not None:
            before_metrics = on_stop

            def on_stop() -> None:
                metrics.close()
                if before_metrics is not None:
                    before_metrics()

    logger.info("serving %s on port %d", ", ".join(service_names), port)
    return RunningServer(server, port, health_servicer, service_names, settings.drain_seconds, on_stop)


def _start_health_server(settings: ServerSettings, health_servicer: health.HealthServicer) -> grpc.Server:
    """grpc.health.v1 alone, in plaintext, on settings.health_port (it shares the main server's status)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{settings.host}:{settings.health_port}"
    try:
        port = server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port == 0:
        raise OSError(f"cannot bind the health port {address} (is the port in use?)")
    server.start()
    return server


def serve_until_signal(running: RunningServer) -> None:
    """Blocks until SIGTERM or SIGINT, then drains and returns."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):  # a timed wait keeps the main thread responsive to signals
        pass
    logger.info("draining (up to %.0f s)", running.drain_seconds)
    running.stop()
    logger.info("stopped")
