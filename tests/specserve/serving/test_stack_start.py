"""A stack's wait for a child: a start that keeps logging may outlast the silence bound and is seen as
soon as it serves, one that stops logging is given up on after it, and every start is bounded in all.
Real child processes and a real gRPC health server; seconds scaled down."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from specserve.errors import Unavailable
from specserve.serving.stack import free_port, wait_serving

pytestmark = pytest.mark.integration

# A child that, once imported, measures for `lines` x `interval` s, logging a line every `interval` s until
# it serves health (SERVING), or, told not to serve, `lines` lines and then nothing. Its imports come
# first and the test waits for its first line: an interpreter's start or an extension's load (which holds
# the GIL) on a loaded host is not the silence a test means.
CHILD = textwrap.dedent(
    """
    import sys, threading, time
    from concurrent import futures
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    port, lines, interval, serve = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "1"
    served = threading.Event()

    def progress():
        done = 0
        while done < lines or (serve and not served.is_set()):
            done += 1
            print(f"measuring: {done} / {lines}", flush=True)
            time.sleep(interval)

    threading.Thread(target=progress, daemon=True).start()
    time.sleep(lines * interval)
    if serve:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        servicer = health.HealthServicer()
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        server.add_insecure_port(f"localhost:{port}")
        server.start()
        served.set()
        print(f"serving since {time.time()}", flush=True)
    time.sleep(60)
    """
)


Child = tuple[str, subprocess.Popen, Path]  # its address, its process, its log


def start_child(tmp_path: Path, lines: int, interval: float, serve: bool) -> Child:
    port, log = free_port(), tmp_path / "child.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(port), str(lines), str(interval), "1" if serve else "0"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    began = time.monotonic()
    while not log.read_text() and process.poll() is None and time.monotonic() - began < 60.0:
        time.sleep(0.02)
    assert log.read_text(), f"the child logged nothing (exit code {process.poll()})"
    return f"localhost:{port}", process, log


@pytest.fixture
def child(tmp_path):
    started = []

    def start(lines: int, interval: float, serve: bool) -> Child:
        started.append(start_child(tmp_path, lines, interval, serve))
        return started[-1]

    yield start
    for _, process, _ in started:
        process.kill()
        process.wait()


def test_a_start_that_keeps_logging_may_outlast_the_silence_bound_and_is_seen_as_it_serves(child):
    address, process, log = child(lines=40, interval=0.25, serve=True)  # about 10 s of progress, then serves
    began = time.monotonic()
    wait_serving(address, 4.0, process, log, limit=60.0)
    seen = time.time()
    assert time.monotonic() - began > 8.0  # longer than the silence bound: the progress kept it waiting
    # Seen within a poll or two of serving: gRPC's default reconnect backoff (1 s, x1.6 a failure) would
    # have its next attempt about 6 s after the 10 s mark.
    serving_since = float(log.read_text().split("serving since ")[1].split()[0])
    assert seen - serving_since < 2.0


def test_a_start_that_falls_silent_is_given_up_on_after_the_silence_bound(child):
    address, process, log = child(lines=1, interval=0.1, serve=False)
    began = time.monotonic()
    with pytest.raises(Unavailable, match="silent for 2 s"):
        wait_serving(address, 2.0, process, log, limit=30.0)
    assert time.monotonic() - began < 10.0


def test_a_start_that_logs_forever_is_bounded_in_all(child):
    address, process, log = child(lines=1000, interval=0.2, serve=False)
    began = time.monotonic()
    with pytest.raises(Unavailable, match="within"):
        wait_serving(address, 2.0, process, log, limit=4.0)
    assert 3.5 < time.monotonic() - began < 10.0


def test_without_a_log_the_bound_counts_from_the_start(child):
    address, process, _ = child(lines=8, interval=0.5, serve=True)
    with pytest.raises(Unavailable, match="within"):
        wait_serving(address, 2.0, process, None, limit=30.0)
