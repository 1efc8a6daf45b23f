"""Session state against a real Redis (with a password and append-only persistence, as the stack and the
chart run it): a record Redis lost is written back by the router that drives the session, a retried
append is applied once, a cancellation is a tombstone rather than a silent gap, and a Redis that stays
down gives UNAVAILABLE (never a quiet "cancelled"); two routers never drive one session (leases)."""

from __future__ import annotations

import secrets
import subprocess
import time
from pathlib import Path

import pytest
import redis

from services.router.state import LEASE_SECONDS, SessionRecord, SessionState, SessionStatus
from specserve.core.request import GenerationRequest
from specserve.errors import InvalidArgument, NotFound, Unavailable
from specserve.serving.stack import free_port, redis_server_binary

pytestmark = pytest.mark.integration  # starts a redis-server process

PASSWORD = secrets.token_hex(8)


def start_redis(port: int, data_dir: Path) -> subprocess.Popen:
    persistence = ["--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--dir", str(data_dir)]
    process = subprocess.Popen(
        [
            redis_server_binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--requirepass",
            PASSWORD,
            *persistence,
        ],
        stdout=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port, password=PASSWORD)
    for _ in range(100):
        try:
            client.ping()
            return process
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError("redis did not start")


@pytest.fixture
def server(tmp_path: Path):
    port = free_port()
    process = start_redis(port, tmp_path)
    yield port, process, tmp_path
    process.kill()
    process.wait()


def state_for(port: int, retry_seconds: float = 2.0) -> SessionState:
    return SessionState(
        f"redis://:{PASSWORD}@localhost:{port}/0", ttl_seconds=60, retry_seconds=retry_seconds
    )


def record(session_id: str = "s1") -> SessionRecord:
    request = GenerationRequest.build(method="glide", max_new_tokens=8, seed=7)
    return SessionRecord(session_id, [1, 2, 3], request, owner="alice")


def test_a_record_redis_lost_is_written_back_with_its_tokens(server) -> None:
    port, _, _ = server
    state = state_for(port)
    state.create(record())
    assert state.append("s1", [10, 11])
    state.redis.flushall()  # what a restart without persistence (or a lost fsync second) leaves
    assert state.append("s1", [12])
    restored, tokens = state.load("s1")
    assert tokens == [10, 11, 12]
    assert restored.owner == "alice" and restored.status == SessionStatus.RUNNING
    assert restored.request == record().request  # the request comes back whole


def test_tokens_redis_lost_are_written_again_and_a_repeated_append_lands_once(server) -> None:
    port, _, _ = server
    state = state_for(port)
    state.create(record())
    assert state.append("s1", [10, 11, 12])
    state.redis.rpop(state.key("s1") + ":tokens")  # the last write was lost
    assert state.append("s1", [13])
    assert state.load("s1")[1] == [10, 11, 12, 13]
    state.redis.rpush(state.key("s1") + ":tokens", 14)  # an append that landed although it timed out
    state._local["s1"][1].append(14)
    assert state.append("s1", [15])
    assert state.load("s1")[1] == [10, 11, 12, 13, 14, 15]


def cancelled_elsewhere(port: int) -> SessionState:
    """The state of a router driving session s1 after another router cancelled it (Cancel went there)."""
    driver, other = state_for(port), state_for(port)
    driver.create(record())
    assert driver.append("s1", [10])
    other.load("s1")
    assert other.delete("s1")  # a tombstone the driver will see
    assert not driver.append("s1", [11])  # the driving router stops: not written back
    return driver


def test_a_cancelled_session_is_a_tombstone(server) -> None:
    port, _, _ = server
    state = cancelled_elsewhere(port)
    with pytest.raises(NotFound):
        state.load("s1")
    state.create(record())  # the id can be used again (a retried generation)
    with pytest.raises(InvalidArgument):
        state.create(record())  # but not while it is live


def test_a_restarted_redis_keeps_the_sessions_from_its_append_only_file(server) -> None:
    port, process, data_dir = server
    state = state_for(port, retry_seconds=20.0)
    state.create(record())
    assert state.append("s1", [10, 11])
    time.sleep(1.2)  # appendfsync everysec
    process.kill()
    process.wait()
    restarted = start_redis(port, data_dir)
    try:
        assert state.append("s1", [12])  # reconnects and retries
        assert state.load("s1")[1] == [10, 11, 12]
    finally:
        restarted.kill()
        restarted.wait()


def test_redis_down_for_longer_than_the_retries_is_unavailable(server) -> None:
    port, process, _ = server
    state = state_for(port, retry_seconds=1.0)
    state.create(record())
    process.kill()
    process.wait()
    start = time.monotonic()
    with pytest.raises(Unavailable):
        state.append("s1", [10])
    assert 1.0 <= time.monotonic() - start < 15.0


def test_two_routers_never_drive_one_session(server) -> None:
    port, _, _ = server
    first, second = state_for(port), state_for(port)
    first.create(record())  # the creating router holds the lease
    second.load("s1")
    with pytest.raises(Unavailable, match="another router"):
        second.take_lease("s1", wait_seconds=0.5)
    first.release_lease("s1")  # its generation ended (the client went to another router)
    second.take_lease("s1", wait_seconds=0.5)
    assert second.append("s1", [10])
    with pytest.raises(Unavailable, match="another router"):  # the old router must stop, quietly
        first.append("s1", [99])
    assert second.load("s1")[1] == [10]  # nothing of the old router's landed; no tombstone either


def test_a_dead_routers_lease_expires(server) -> None:
    port, _, _ = server
    dead, alive = state_for(port), state_for(port)
    dead.create(record())
    dead._closed.set()  # its heartbeat stops, as if the process died (nothing released)
    alive.load("s1")
    start = time.monotonic()
    alive.take_lease("s1")  # waits for the expiry
    assert time.monotonic() - start < LEASE_SECONDS + 1.5
    assert alive.append("s1", [10])


def test_the_driving_router_clears_a_cancelled_session_completely(server) -> None:
    port, _, _ = server
    driver = cancelled_elsewhere(port)
    driver.delete("s1", tombstone=False)  # the driver's cleanup
    driver.release_lease("s1")
    assert not driver.redis.keys("specserve:session:s1*")
