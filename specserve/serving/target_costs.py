"""The serving targets' published costs, as drafts and the router size trees by them.

Each target replica measures its own verify curve and publishes it (ModelInfo.costs). A draft replica
(per session's Prefill) and the router (per session, for suffix candidates) fetch it per target address
and keep it for a while, so a replica on other hardware, or one restarted on another kernel, is followed
within `refresh_seconds` without a call per session. Torch-free: the router uses it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc

from specserve.core.cost import VerifyPoints
from specserve.errors import Unavailable
from specserve.serving.convert import costs_from_pb
from specserve.v1 import target_pb2, target_pb2_grpc

REFRESH_SECONDS = 60.0
CALL_TIMEOUT_SECONDS = 10.0


class PublishedCosts:
    def __init__(
        self,
        stub_for: Callable[[str], target_pb2_grpc.TargetServiceStub],
        refresh_seconds: float = REFRESH_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stub_for = stub_for
        self.refresh_seconds = refresh_seconds
        self.clock = clock
        self._lock = threading.Lock()
        # address -> (fetched, version, curve, prefix cache block tokens)
        self._known: dict[str, tuple[float, str, VerifyPoints, int]] = {}

    def of(self, address: str) -> VerifyPoints:
        """The verify curve the target at `address` publishes (fetched at most every refresh_seconds)."""
        with self._lock:
            known = self._known.get(address)
        if known is not None and self.clock() - known[0] < self.refresh_seconds:
            return known[2]
        try:
            info = self.stub_for(address).GetModelInfo(
                target_pb2.GetModelInfoRequest(), timeout=CALL_TIMEOUT_SECONDS
            )
        except grpc.RpcError as e:
            if known is not None:  # a passing outage: the last curve still describes that replica
                return known[2]
            raise Unavailable(f"target {address} did not give its costs: {e.code().name}") from None
        points = costs_from_pb(info.costs)
        with self._lock:
            self._known[address] = (self.clock(), info.costs.version, points, info.prefix_cache_block_tokens)
        return points

    def block_tokens(self, address: str) -> int:
        """The prefill chunk the target at `address` caches prompt blocks in (0: it keeps no cache)."""
        self.of(address)
        with self._lock:
            return self._known[address][3]

    def version(self, address: str) -> str | None:
        """The version of the curve held for `address` (None: none fetched yet)."""
        with self._lock:
            known = self._known.get(address)
        return None if known is None else known[1]
