"""uvicorn on a thread of the router process: started before the router reports SERVING, stopped (with
the same drain time as gRPC) when it stops."""

from __future__ import annotations

import logging
import threading
import time

import uvicorn

from services.router.http.app import BodyLimit, create_app
from services.router.servicer import RouterServicer
from specserve.serving.auth import BearerTokenASGI, TokenSet

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_SECONDS = 30.0


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, but an idle connection is dropped at shutdown instead of waited for.

    uvicorn closes idle keep-alive connections when it shuts down and then waits for them to go. Over
    TLS, closing means a close_notify exchange that an idle client (one holding a pooled connection it
    is not using) never answers, so every such connection held the drain for its whole time (20 s) with
    no request left to finish. Connections with a request in flight still get the drain time."""

    async def shutdown(self, sockets: list | None = None) -> None:
        for connection in list(self.server_state.connections):
            cycle = getattr(connection, "cycle", None)
            transport = getattr(connection, "transport", None)
            if transport is not None and (cycle is None or getattr(cycle, "response_complete", False)):
                transport.abort()
        await super().shutdown(sockets)


class HttpServer:
    def __init__(self, servicer: RouterServicer, host: str, port: int, drain_seconds: float) -> None:
        # The gRPC API's bearer tokens, here as OpenAI API keys (serving/auth.py).
        tokens = TokenSet(servicer.settings.auth_tokens, servicer.settings.auth_token_file)
        limited = BodyLimit(create_app(servicer, tokens.enabled), servicer.settings.http_max_body_bytes)
        app = BearerTokenASGI(limited, tokens)
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_config=None,  # keep the process's logging as it is
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=max(1, round(drain_seconds)),
            # HTTPS with the router's own certificate when its gRPC API uses TLS
            ssl_certfile=servicer.settings.tls_cert_file or None,
            ssl_keyfile=servicer.settings.tls_key_file or None,
        )
        self.server = _DrainingServer(config)
        self.thread = threading.Thread(target=self.server.run, name="http", daemon=True)
        self.port = 0

    def start(self) -> HttpServer:
        self.thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise OSError(
                    f"the HTTP API could not bind {self.server.config.host}:{self.server.config.port}"
                )
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        logger.info("serving the HTTP API on port %d", self.port)
        return self

    def begin_stop(self) -> None:
        """Stop accepting connections; open ones get the drain time to finish (then they are cancelled)."""
        self.server.should_exit = True

    def stop(self) -> None:
        self.begin_stop()
        self.thread.join()
