"""The router's heartbeat: it renews the leases of the sessions it drives on the targets and drafts.

The target and the draft release a session whose lease lapsed (specserve/serving/expiry.py): that is
how the sessions of a router that died are freed within seconds rather than held until the idle
timeout. Calls renew a lease too, but a live router can leave a session alone for a while (a round
waiting on Redis or on a restarting target, rounds that need no draft), so this thread renews every
session a run holds (placement.HeldReplica lists it in its ReplicaSet) with one Renew call per replica:
every third of the lease the replica reports, and at least every MAX_INTERVAL_SECONDS.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import grpc

from services.router.placement import ReplicaSet
from specserve.v1 import lease_pb2, lease_pb2_grpc

logger = logging.getLogger(__name__)

MAX_INTERVAL_SECONDS = 2.0
MIN_INTERVAL_SECONDS = 0.2
CALL_TIMEOUT_SECONDS = 2.0

ChannelFor = Callable[[str], grpc.Channel]  # address -> the router's channel to it


class LeaseRenewer:
    def __init__(self, replicas: Sequence[tuple[ReplicaSet, ChannelFor]]) -> None:
        self.replicas = list(replicas)
        self.interval = MAX_INTERVAL_SECONDS  # until a replica reports its lease
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="session-lease-renewals", daemon=True)

    def start(self) -> LeaseRenewer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(CALL_TIMEOUT_SECONDS + 1)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.renew()

    def renew(self) -> None:
        """One Renew per replica holding sessions, all in flight at once: a dead replica holds up no
        other. Failures are left alone: the next call to that replica finds out, and its sessions
        there are rebuilt if they expired meanwhile."""
        calls = []
        for replica_set, channel_for in self.replicas:
            for address, session_ids in replica_set.sessions().items():
                stub = lease_pb2_grpc.SessionLeaseServiceStub(channel_for(address))
                request = lease_pb2.RenewLeasesRequest(session_ids=session_ids)
                calls.append((address, stub.Renew.future(request, timeout=CALL_TIMEOUT_SECONDS)))
        leases = []
        for address, call in calls:
            try:
                leases.append(call.result().lease_seconds)
            except grpc.RpcError as e:
                logger.debug("renewing leases on %s: %s", address, e.code())
        if leases_held := [s for s in leases if s > 0]:
            self.interval = min(MAX_INTERVAL_SECONDS, max(MIN_INTERVAL_SECONDS, min(leases_held) / 3))
