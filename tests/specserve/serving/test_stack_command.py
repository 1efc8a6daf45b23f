"""`specserve stack`, the README's main command, as a user runs it: a real generation streamed through the
local stack, then SIGTERM (what `kill`, a container runtime or a CI timeout sends) stops every process."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time

import pytest

from specserve.serving.stack import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.model, pytest.mark.timeout(300)]

MAX_NEW_TOKENS = 8


def free_base_port() -> int:
    """A port whose next three are free too (router, target, draft, redis)."""
    while True:
        base = free_port()
        if base + 3 < 65536 and all(not port_open(base + i) for i in range(4)):
            return base


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_stack_streams_a_generation_and_sigterm_stops_every_process():
    base = free_base_port()
    command = [sys.executable, "-m", "specserve.cli", "stack", "--base-port", str(base)]
    command += ["--max-new-tokens", str(MAX_NEW_TOKENS), "Name a prime number."]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 240
    while not any("stack serving" in line for line in lines):
        assert process.poll() is None, "".join(lines)
        assert time.monotonic() < deadline, "".join(lines)
        time.sleep(0.5)
    output = "".join(lines)
    assert re.search(r"via router\] [1-9][0-9]* tokens", output), output
    assert all(port_open(base + i) for i in range(4))

    process.terminate()
    assert process.wait(90) == 0, "".join(lines)
    reader.join(10)
    # Redis and the three services went with it: nothing listens on their ports any more.
    assert not any(port_open(base + i) for i in range(4)), "".join(lines)
