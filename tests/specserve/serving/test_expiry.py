"""Session expiry on the target and the draft: a lease that lapses without calls or renewals (the router
died), an idle timeout that renewals do not reset, no release while a call runs; and the same over real
gRPC (no model): calls and Renew keep a session, Release forgets it, the reaper releases the rest."""

from __future__ import annotations

import time

import grpc
import pytest
from session_only_target import SessionOnlyTarget

from specserve.serving.expiry import SessionExpiry
from specserve.serving.server import start_server
from specserve.serving.settings import TargetServiceSettings
from specserve.v1 import lease_pb2, lease_pb2_grpc, target_pb2, target_pb2_grpc


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_idle_sessions_are_released_after_the_timeout() -> None:
    clock, released = Clock(), []
    idle = SessionExpiry(10.0, released.append, clock=clock)
    idle.touch("a")
    clock.now = 6.0
    idle.touch("b")
    clock.now = 11.0
    assert idle.reap() == ["a"]
    idle.touch("b")  # activity keeps it
    clock.now = 20.0
    assert idle.reap() == []
    idle.forget("b")  # released by its router
    clock.now = 100.0
    assert idle.reap() == [] and released == ["a"]


def test_a_lease_lapses_without_calls_or_renewals_and_renewals_do_not_reset_the_idle_clock() -> None:
    clock, released = Clock(), []
    expiry = SessionExpiry(60.0, released.append, clock=clock, lease_seconds=15.0)
    expiry.touch("driven")
    expiry.touch("abandoned")  # its router died after this call
    for clock.now in (5.0, 10.0, 15.0, 20.0):
        expiry.renew(["driven", "never-called"])  # the heartbeat of the router that lives
        expiry.reap()
    assert released == ["abandoned"]
    for clock.now in (30.0, 45.0, 61.0):
        expiry.renew(["driven"])
        expiry.reap()
    assert released == ["abandoned", "driven"]  # renewed, but idle: no call for 60 s
    assert expiry.reap() == []  # an id only renewed was never tracked


def test_a_session_with_a_call_in_flight_is_never_released() -> None:
    clock, released = Clock(), []
    expiry = SessionExpiry(10.0, released.append, clock=clock, lease_seconds=5.0)
    with expiry.calling("long-prefill"):
        clock.now = 100.0
        assert expiry.reap() == []
    clock.now = 104.0
    assert expiry.reap() == []  # the call's end counts as activity
    clock.now = 106.0
    assert expiry.reap() == ["long-prefill"]


@pytest.mark.timeout(60)
def test_over_grpc_renewed_sessions_stay_and_abandoned_ones_are_released() -> None:
    sessions = SessionOnlyTarget()
    lease = 3.0
    settings = TargetServiceSettings(
        host="127.0.0.1", port=0, metrics_port=0, session_lease_seconds=lease, session_idle_seconds=600
    )
    running = start_server(
        settings,
        lambda server: target_pb2_grpc.add_TargetServiceServicer_to_server(sessions, server),
        ("specserve.v1.TargetService",),
        release_session=lambda session_id: sessions.Release(
            target_pb2.ReleaseRequest(session_id=session_id), None
        ),
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            target = target_pb2_grpc.TargetServiceStub(channel)
            leases = lease_pb2_grpc.SessionLeaseServiceStub(channel)
            for session_id in ("driven", "abandoned", "released"):
                target.Prefill(target_pb2.PrefillRequest(session_id=session_id), timeout=10)
            target.Release(target_pb2.ReleaseRequest(session_id="released"), timeout=10)
            deadline = time.monotonic() + lease * 3
            while time.monotonic() < deadline:
                response = leases.Renew(lease_pb2.RenewLeasesRequest(session_ids=["driven"]), timeout=10)
                assert response.lease_seconds == lease
                time.sleep(lease / 3)
            assert sessions.open == {"driven"}
            with pytest.raises(grpc.RpcError) as error:
                leases.Renew(lease_pb2.RenewLeasesRequest(session_ids=["x"] * 10_001), timeout=10)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        running.stop(0)
