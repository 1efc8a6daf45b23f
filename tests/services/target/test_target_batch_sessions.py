"""The target reports the sessions sharing its forwards (those that prefilled or verified within the last
second) with every Prefill and Verify: the load a session's draft sizes its trees by, known from the
session's first round.

Over real gRPC on the shared stack's target process.
"""

from __future__ import annotations

import time

import pytest

from specserve.v1 import common_pb2, target_pb2, target_pb2_grpc

pytestmark = [pytest.mark.distributed, pytest.mark.model, pytest.mark.timeout(240)]

PROMPT_IDS = [1, 9690, 198, 19556, 28, 638, 359, 346, 47, 2]
RECENT_SECONDS = 1.1  # past the target's horizon (serving/recent.py): earlier tests' sessions left it


def test_prefill_and_verify_report_the_sessions_sharing_the_target(channels):
    stub = target_pb2_grpc.TargetServiceStub(channels["target"])

    def prefill(session_id: str) -> target_pb2.PrefillResponse:
        request = target_pb2.PrefillRequest(session_id=session_id, token_ids=PROMPT_IDS, capacity=128)
        return stub.Prefill(request, timeout=60)

    def verify(session_id: str, root: int) -> target_pb2.VerifyResponse:
        tree = common_pb2.DraftTree(token_ids=[root], parent_ids=[-1], kind=common_pb2.CANDIDATE_KIND_FIXED)
        request = target_pb2.VerifyRequest(
            session_id=session_id, tree=tree, committed_length=len(PROMPT_IDS) + 1
        )
        return stub.Verify(request, timeout=60)

    time.sleep(RECENT_SECONDS)
    try:
        assert prefill("load-a").batch_sessions == 1
        second = prefill("load-b")
        assert second.batch_sessions == 2
        stub.Release(target_pb2.ReleaseRequest(session_id="load-a"), timeout=60)
        assert verify("load-b", second.next_token).batch_sessions == 1  # a released session leaves
    finally:
        for session_id in ("load-a", "load-b"):
            stub.Release(target_pb2.ReleaseRequest(session_id=session_id), timeout=60)
