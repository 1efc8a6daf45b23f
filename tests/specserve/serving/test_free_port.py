"""free_port hands out ports no outgoing connection can take before the server binds them."""

from __future__ import annotations

import socket

from specserve.serving import stack


def test_ports_come_from_below_the_ephemeral_range_and_are_free() -> None:
    low = int(stack.EPHEMERAL_RANGE_FILE.read_text().split()[0])
    ports = {stack.free_port() for _ in range(20)}
    assert all(p < low for p in ports)
    assert len(ports) > 1  # drawn at random, so concurrent stacks rarely meet
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # raises if it was not free


def test_a_taken_port_is_never_handed_out(monkeypatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(stack, "LISTEN_PORTS", range(taken, taken + 1))
        monkeypatch.setattr(stack, "EPHEMERAL_RANGE_FILE", stack.Path("/nonexistent"))
        # The only candidate is taken: the kernel's choice is the fallback, never the taken port.
        assert stack.free_port() != taken
