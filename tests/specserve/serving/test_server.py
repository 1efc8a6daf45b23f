"""start_server on its own (no model): a port already in use is an error, not a silent second server."""

from __future__ import annotations

import pytest

from specserve.serving.server import start_server
from specserve.serving.settings import ServerSettings


def test_a_second_server_on_a_busy_port_fails_to_start():
    first = start_server(ServerSettings(host="127.0.0.1"), lambda server: None, ())
    try:
        busy = ServerSettings(host="127.0.0.1", port=first.port)
        # gRPC's default SO_REUSEPORT would let this bind and take half of the first server's traffic.
        with pytest.raises(OSError, match="cannot bind"):
            start_server(busy, lambda server: None, ())
    finally:
        first.stop(grace=0)
