"""The router's heartbeat keeps the sessions its runs hold alive on a service with short leases, through
a gap with no call at all; a session no run holds any more is let go. Real gRPC, no model: a service
with sessions and nothing else, the router's own channel code, and its paced renewals."""

from __future__ import annotations

import time

import pytest
from session_only_target import SessionOnlyTarget

from services.router.leases import LeaseRenewer
from services.router.placement import HeldReplica, ReplicaSet
from specserve.serving.server import channel_options, start_server
from specserve.serving.settings import TargetServiceSettings
from specserve.serving.telemetry import traced_channel
from specserve.v1 import target_pb2, target_pb2_grpc

LEASE_SECONDS = 3.0


@pytest.mark.timeout(60)
def test_held_sessions_outlive_a_gap_longer_than_the_lease_and_released_ones_expire() -> None:
    sessions = SessionOnlyTarget()
    settings = TargetServiceSettings(
        host="127.0.0.1", port=0, metrics_port=0, session_lease_seconds=LEASE_SECONDS
    )
    running = start_server(
        settings,
        lambda server: target_pb2_grpc.add_TargetServiceServicer_to_server(sessions, server),
        ("specserve.v1.TargetService",),
        release_session=lambda s: sessions.Release(target_pb2.ReleaseRequest(session_id=s), None),
    )
    address = f"127.0.0.1:{running.port}"
    channel = traced_channel(address, channel_options(settings))
    replicas = ReplicaSet([address])
    renewer = LeaseRenewer([(replicas, lambda _: channel)]).start()
    try:
        target = target_pb2_grpc.TargetServiceStub(channel)
        held = {s: HeldReplica(replicas, s) for s in ("waiting-on-redis", "finished")}
        for session_id in held:
            target.Prefill(target_pb2.PrefillRequest(session_id=session_id), timeout=10)
        held["finished"].release()  # its run ended without a Release reaching the service
        time.sleep(LEASE_SECONDS * 2.5)  # no call at all meanwhile
        assert sessions.open == {"waiting-on-redis"}
        assert renewer.interval == pytest.approx(LEASE_SECONDS / 3)  # paced by the lease it reported
    finally:
        renewer.close()
        channel.close()
        running.stop(0)
