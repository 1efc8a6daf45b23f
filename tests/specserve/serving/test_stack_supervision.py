"""`specserve stack --tls --token ...` as a user runs it: the demo streams over TLS with a token; a child
killed with SIGKILL is restarted with a clear line on stderr while the others keep serving; the CLI's
`generate --remote` needs the token and the CA."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from specserve.serving.stack import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.model, pytest.mark.timeout(400)]

TOKEN = "cli-token"


def free_base_port() -> int:
    while True:
        base = free_port()
        ports = range(base, base + 4)
        if base + 3 < 65536 and all(socket.socket().connect_ex(("127.0.0.1", p)) != 0 for p in ports):
            return base


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")


def wait_for(lines: list[str], pattern: str, process: subprocess.Popen, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while True:
        for line in list(lines):
            match = re.search(pattern, line)
            if match:
                return match
        assert process.poll() is None, "".join(lines)
        assert time.monotonic() < deadline, f"no {pattern!r} in:\n" + "".join(lines)
        time.sleep(0.3)


def generate(base: int, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "specserve.cli", "generate", "--remote", f"localhost:{base}"]
    command += [*extra, "--max-new-tokens", "4", "--json", "Name a colour."]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_a_killed_child_is_restarted_and_the_stack_keeps_serving_over_tls() -> None:
    base = free_base_port()
    command = [sys.executable, "-m", "specserve.cli", "stack", "--base-port", str(base), "--tls"]
    command += ["--token", TOKEN, "--max-new-tokens", "8", "Name a prime number."]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    try:
        wait_for(lines, r"stack serving", process, 300)
        assert re.search(r"via router\] [1-9][0-9]* tokens", "".join(lines))
        ca = wait_for(lines, r"clients verify the router with (\S+)", process, 5).group(1)

        # The CLI client: the token and the CA are both needed.
        done = generate(base, "--token", TOKEN, "--tls-ca", ca)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["token_ids"]
        refused = generate(base, "--tls-ca", ca)
        assert refused.returncode != 0 and "missing or invalid credentials" in refused.stderr

        # SIGKILL the target (the slowest to come back): the stack restarts it, the rest keeps serving.
        (target,) = [pid for pid in children(process.pid) if "serve target" in cmdline(pid)]
        router_before = [pid for pid in children(process.pid) if "serve router" in cmdline(pid)]
        os.kill(target, signal.SIGKILL)
        wait_for(
            lines,
            rf"stack: target \(pid {target}\) exited with code -9; the others keep serving",
            process,
            30,
        )
        wait_for(lines, r"stack: target is serving again", process, 240)
        assert [pid for pid in children(process.pid) if "serve router" in cmdline(pid)] == router_before
        again = generate(base, "--token", TOKEN, "--tls-ca", ca)
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout)["token_ids"] == json.loads(done.stdout)["token_ids"]
    finally:
        process.terminate()
        assert process.wait(90) == 0, "".join(lines)
        reader.join(10)
