"""A stack that is told to stop twice still stops everything: the second SIGTERM (or Ctrl-C) arriving while
it stops must not interrupt it halfway and leave Redis or a service orphaned on its ports.

A real stack in a child process (Redis alone, plus a stand-in service that takes two seconds to drain),
the `specserve stack` SIGTERM handler installed; the test signals it while it stops.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = """
import signal, subprocess, sys
from specserve.app.serve import _interrupt
from specserve.serving.stack import LocalStack

signal.signal(signal.SIGTERM, _interrupt)  # as `specserve stack` does
stack = LocalStack(roles=()).__enter__()  # Redis alone
slow = (
    "import signal, time; signal.signal(signal.SIGTERM, lambda *a: (time.sleep(2), exit(0))); "
    "print('draining on SIGTERM', flush=True); time.sleep(60)"
)
stack.processes["draft"] = subprocess.Popen([sys.executable, "-c", slow], stdout=subprocess.PIPE)
stack.processes["draft"].stdout.readline()  # its handler is in place
print(stack.processes["redis"].pid, stack.processes["draft"].pid, flush=True)
sys.stdin.readline()  # the test is ready to signal
try:
    stack.stop()
except KeyboardInterrupt:
    print("interrupted", flush=True)
    raise
print("stopped", flush=True)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of an exited child still answers kill(0): read its state
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_second_sigterm_while_stopping_leaves_nothing_running() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        redis_pid, draft_pid = map(int, child.stdout.readline().split())
        child.stdin.write("go\n")
        child.stdin.flush()
        time.sleep(0.5)  # stopping: the stand-in drains for two seconds
        child.send_signal(signal.SIGTERM)
        child.send_signal(signal.SIGTERM)
        out, _ = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    deadline = time.monotonic() + 10
    while (alive(redis_pid) or alive(draft_pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    orphans = [pid for pid in (redis_pid, draft_pid) if alive(pid)]
    for pid in orphans:  # what a failing stop left behind must not outlive the test
        os.kill(pid, signal.SIGKILL)
    assert "stopped" in out and "interrupted" not in out
    assert child.returncode == 0
    assert orphans == []
