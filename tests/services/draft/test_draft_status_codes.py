"""DraftService answers bad requests with the status code the API promises, over real gRPC.

Called directly (no router in between) on the shared stack's draft process.
"""

from __future__ import annotations

import grpc
import pytest

from specserve.v1 import draft_pb2, draft_pb2_grpc

pytestmark = [pytest.mark.distributed, pytest.mark.model, pytest.mark.timeout(240)]

INVALID = grpc.StatusCode.INVALID_ARGUMENT
PROMPT_IDS = [1, 9690, 198, 19556, 28, 638, 359, 346, 47, 2]


@pytest.fixture(scope="module")
def stub(channels) -> draft_pb2_grpc.DraftServiceStub:
    return draft_pb2_grpc.DraftServiceStub(channels["draft"])


def prefill(shared_stack, **overrides) -> draft_pb2.DraftPrefillRequest:
    fields = {
        "session_id": "draft-status-codes",
        "method": "glide",
        "token_ids": PROMPT_IDS,
        "target_address": shared_stack.address("target"),
        "capacity": 256,
    } | overrides
    return draft_pb2.DraftPrefillRequest(**fields)


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"method": "no-such-method"}, id="unknown-method"),
        pytest.param({"method": ""}, id="empty-method"),
        pytest.param({"method": "target"}, id="method-that-drafts-nothing"),
        pytest.param({"session_id": "bad/id"}, id="bad-session-id"),
        pytest.param({"token_ids": []}, id="empty-token-ids"),
        pytest.param({"target_address": ""}, id="no-target-address"),
        pytest.param({"capacity": len(PROMPT_IDS)}, id="capacity-not-above-the-tokens"),
        pytest.param({"capacity": 10**6}, id="capacity-above-max-context"),
    ],
)
def test_prefill_rejects_bad_requests_with_invalid_argument(stub, shared_stack, expect_status, overrides):
    details = expect_status(INVALID, stub.Prefill, prefill(shared_stack, **overrides))
    if overrides.get("method") == "no-such-method":
        assert "no-such-method" in details


def test_propose_on_an_unknown_session_is_not_found(stub, expect_status):
    request = draft_pb2.ProposeRequest(session_id="never-created", from_position=0, new_token_ids=[1, 2])
    details = expect_status(grpc.StatusCode.NOT_FOUND, stub.Propose, request)
    assert "never-created" in details


def test_propose_beyond_what_the_draft_knows_is_not_found(stub, shared_stack, expect_status):
    """A router that thinks the draft has more tokens than it does must prefill it again."""
    stub.Prefill(prefill(shared_stack, session_id="draft-known-length"), timeout=60)
    try:
        request = draft_pb2.ProposeRequest(
            session_id="draft-known-length",
            from_position=len(PROMPT_IDS) + 1,
            new_token_ids=[5],
            target_address=shared_stack.address("target"),
        )
        expect_status(grpc.StatusCode.NOT_FOUND, stub.Propose, request)
    finally:
        released = stub.Release(draft_pb2.DraftReleaseRequest(session_id="draft-known-length"), timeout=60)
    assert released.released


def test_propose_with_a_bad_session_id_is_invalid_argument(stub, expect_status):
    expect_status(INVALID, stub.Propose, draft_pb2.ProposeRequest(session_id=""))


def test_release_of_an_unknown_session_is_not_an_error(stub):
    assert not stub.Release(draft_pb2.DraftReleaseRequest(session_id="never-created"), timeout=60).released
