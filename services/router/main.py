"""`specserve serve router`: the router process. Imports no torch (a test checks)."""

from __future__ import annotations

from services.router.servicer import RouterServicer
from services.router.state import SessionState
from specserve.serving.metrics import RouterMetrics
from specserve.serving.server import RunningServer, start_server
from specserve.serving.settings import RouterServiceSettings
from specserve.v1 import router_pb2_grpc

SERVICE_NAME = "specserve.v1.RouterService"


def start_router(settings: RouterServiceSettings) -> RunningServer:
    state = SessionState(
        settings.redis_url,
        settings.session_ttl_seconds,
        retry_seconds=settings.redis_retry_seconds,
        ssl_ca_file=settings.redis_ca_file,
        ssl_cert_file=settings.redis_cert_file,
        ssl_key_file=settings.redis_key_file,
    )
    state.ping()
    metrics = RouterMetrics.create()
    servicer = RouterServicer(settings, metrics, state)
    http = None
    if settings.http_port:  # up before gRPC reports SERVING, so a ready router serves both
        from services.router.http.server import HttpServer

        http = HttpServer(servicer, settings.host, settings.http_port, settings.drain_seconds).start()

    def stop() -> None:  # after the gRPC drain: wait for the HTTP API's (begun alongside), then close
        if http is not None:
            http.stop()
        servicer.close()

    running = start_server(
        settings,
        lambda server: router_pb2_grpc.add_RouterServiceServicer_to_server(servicer, server),
        (SERVICE_NAME,),
        metrics.registry,
        on_stop=stop,
    )
    if http is not None:  # both listeners drain at once, within the one drain time
        running.on_drain = http.begin_stop
    return running
