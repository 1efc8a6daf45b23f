"""TargetService answers bad requests with the status code the API promises, over real gRPC.

Called directly (no router in between) on the shared stack's target process.
"""

from __future__ import annotations

import grpc
import pytest

from specserve.v1 import common_pb2, target_pb2

pytestmark = [pytest.mark.distributed, pytest.mark.model, pytest.mark.timeout(240)]

INVALID = grpc.StatusCode.INVALID_ARGUMENT
PROMPT_IDS = [1, 9690, 198, 19556, 28, 638, 359, 346, 47, 2]  # a short ChatML-looking prompt
SESSION = "target-status-codes"
FIXED = common_pb2.CANDIDATE_KIND_FIXED


@pytest.fixture(scope="module")
def session(stub, info):
    """A real session: (session id, next token, committed length). Released afterwards."""
    capacity = len(PROMPT_IDS) + 1 + info.max_tree_nodes + 16
    response = stub.Prefill(
        target_pb2.PrefillRequest(session_id=SESSION, token_ids=PROMPT_IDS, capacity=capacity), timeout=60
    )
    assert response.committed_length == len(PROMPT_IDS)
    yield SESSION, response.next_token, response.committed_length
    assert stub.Release(target_pb2.ReleaseRequest(session_id=SESSION), timeout=60).released


def prefill(info: target_pb2.ModelInfo, **overrides) -> target_pb2.PrefillRequest:
    fields = {"session_id": "ok-id", "token_ids": PROMPT_IDS, "capacity": 256} | overrides
    if callable(fields["capacity"]):
        fields["capacity"] = fields["capacity"](info)
    return target_pb2.PrefillRequest(**fields)


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"token_ids": []}, id="empty-token-ids"),
        pytest.param({"session_id": ""}, id="empty-session-id"),
        pytest.param({"session_id": "has space"}, id="session-id-bad-characters"),
        pytest.param({"session_id": "x" * 65}, id="session-id-too-long"),
        pytest.param({"capacity": lambda info: info.max_context + 1}, id="capacity-above-max-context"),
        pytest.param({"capacity": 0}, id="capacity-zero"),
        pytest.param({"capacity": len(PROMPT_IDS) + 1}, id="capacity-without-room-for-a-tree"),
        pytest.param({"token_ids": [1, 49152]}, id="token-id-outside-vocab"),
        pytest.param({"sampling": common_pb2.SamplingParams(temperature=-1)}, id="negative-temperature"),
    ],
)
def test_prefill_rejects_bad_requests_with_invalid_argument(stub, info, expect_status, overrides):
    expect_status(INVALID, stub.Prefill, prefill(info, **overrides))


def test_verify_of_an_unknown_session_is_not_found(stub, expect_status):
    tree = common_pb2.DraftTree(token_ids=[2], parent_ids=[-1], kind=FIXED)
    request = target_pb2.VerifyRequest(session_id="never-created", tree=tree, committed_length=5)
    details = expect_status(grpc.StatusCode.NOT_FOUND, stub.Verify, request)
    assert "never-created" in details


def chain(length: int) -> tuple[list[int], list[int]]:
    return [100 + i for i in range(length)], list(range(-1, length - 1))


@pytest.mark.parametrize(
    "tree",
    [
        pytest.param({"token_ids": [5, 6], "parent_ids": [-1, 1]}, id="parent-is-itself"),
        pytest.param({"token_ids": [5, 6, 7], "parent_ids": [-1, 2, 0]}, id="parent-after-child"),
        pytest.param({"token_ids": [5, 6], "parent_ids": [0, 0]}, id="root-has-a-parent"),
        pytest.param({"token_ids": [5, 6], "parent_ids": [-1]}, id="one-parent-missing"),
        pytest.param({"token_ids": [], "parent_ids": []}, id="empty"),
        pytest.param({"kind": common_pb2.CANDIDATE_KIND_UNSPECIFIED}, id="kind-unset"),
        pytest.param({"token_ids": [5, 49152], "parent_ids": [-1, 0]}, id="token-outside-vocab"),
        pytest.param(
            {"draft_probs": [common_pb2.SparseProbs(node=0, token_ids=[6], probs=[1.0])]},
            id="fixed-kind-with-draft-probs",
        ),
        pytest.param({"kind": common_pb2.CANDIDATE_KIND_SAMPLED}, id="sampled-kind-without-draft-probs"),
    ],
)
def test_verify_rejects_malformed_trees_with_invalid_argument(stub, session, expect_status, tree):
    session_id, root, committed = session
    fields = {"token_ids": [root, 6], "parent_ids": [-1, 0], "kind": FIXED} | tree
    request = target_pb2.VerifyRequest(
        session_id=session_id, tree=common_pb2.DraftTree(**fields), committed_length=committed + 1
    )
    expect_status(INVALID, stub.Verify, request)


def test_verify_rejects_a_tree_above_max_nodes(stub, info, session, expect_status):
    session_id, root, committed = session
    token_ids, parent_ids = chain(info.max_tree_nodes + 2)  # root + max_tree_nodes drafts is the limit
    token_ids[0] = root
    request = target_pb2.VerifyRequest(
        session_id=session_id,
        tree=common_pb2.DraftTree(token_ids=token_ids, parent_ids=parent_ids, kind=FIXED),
        committed_length=committed + 1,
    )
    details = expect_status(INVALID, stub.Verify, request)
    assert str(info.max_tree_nodes + 1) in details


def test_verify_with_a_stale_committed_length_is_failed_precondition_and_commits_nothing(
    stub, session, expect_status
):
    session_id, root, committed = session
    tree = common_pb2.DraftTree(token_ids=[root], parent_ids=[-1], kind=FIXED)
    for wrong in (committed, committed + 2, 0):
        request = target_pb2.VerifyRequest(session_id=session_id, tree=tree, committed_length=wrong)
        expect_status(grpc.StatusCode.FAILED_PRECONDITION, stub.Verify, request)
    # The rejected calls committed nothing: the right length still verifies, exactly one position on.
    ok = stub.Verify(
        target_pb2.VerifyRequest(session_id=session_id, tree=tree, committed_length=committed + 1), timeout=60
    )
    assert list(ok.accepted_nodes) == [0]
    assert ok.committed_length == committed + 2


@pytest.mark.parametrize(
    "layers",
    [
        pytest.param(lambda info: [info.num_layers], id="one-past-the-last"),
        pytest.param(lambda info: [-1], id="negative"),
        pytest.param(lambda info: [0, 1000], id="one-of-two-bad"),
        pytest.param(lambda info: [], id="none"),
    ],
)
def test_stream_kv_rejects_bad_layers_with_invalid_argument(stub, info, session, expect_status, layers):
    request = target_pb2.StreamKVRequest(session_id=session[0], from_position=0, layers=layers(info))
    expect_status(INVALID, stub.StreamKV, request)


def test_stream_kv_rejects_negative_position_and_unknown_session(stub, session, expect_status):
    negative = target_pb2.StreamKVRequest(session_id=session[0], from_position=-1, layers=[0])
    expect_status(INVALID, stub.StreamKV, negative)
    unknown = target_pb2.StreamKVRequest(session_id="never-created", from_position=0, layers=[0])
    expect_status(grpc.StatusCode.NOT_FOUND, stub.StreamKV, unknown)


def test_release_of_an_unknown_session_is_not_an_error(stub):
    assert not stub.Release(target_pb2.ReleaseRequest(session_id="never-created"), timeout=60).released
