"""A target with sessions and nothing else, for the lease tests: Prefill opens one, Release closes it."""

from __future__ import annotations

import threading

from specserve.v1 import target_pb2, target_pb2_grpc


class SessionOnlyTarget(target_pb2_grpc.TargetServiceServicer):
    def __init__(self) -> None:
        self.open: set[str] = set()
        self.lock = threading.Lock()

    def Prefill(self, request, context):
        with self.lock:
            self.open.add(request.session_id)
        return target_pb2.PrefillResponse()

    def Release(self, request, context):
        with self.lock:
            released = request.session_id in self.open
            self.open.discard(request.session_id)
        return target_pb2.ReleaseResponse(released=released)
