"""Bad requests against the real services of the shared stack: first the inputs a tester found getting
through (or coming back INTERNAL), then Hypothesis generating request messages for every RPC.

Any input must get OK or a documented status code, never INTERNAL or UNKNOWN; afterwards every
service still reports SERVING and a greedy generation still equals the one before the fuzzing.
"""

from __future__ import annotations

import math
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve.errors import MAX_MESSAGE_CHARS
from specserve.v1 import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)

pytestmark = [pytest.mark.distributed, pytest.mark.model, pytest.mark.timeout(300)]

INVALID = grpc.StatusCode.INVALID_ARGUMENT
# What the API documents for bad input and missing state; INTERNAL and UNKNOWN are never acceptable.
DOCUMENTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.OUT_OF_RANGE,
}
PROMPT_IDS = [1, 9690, 198, 19556, 28, 638, 359, 346, 47, 2]
CALL_TIMEOUT = 30.0
FUZZ_EXAMPLES = 100  # per RPC; bounded so the fuzzing itself takes well under a minute
sent = {"requests": 0}


@pytest.fixture(scope="module")
def stubs(channels):
    return (
        router_pb2_grpc.RouterServiceStub(channels["router"]),
        target_pb2_grpc.TargetServiceStub(channels["target"]),
        draft_pb2_grpc.DraftServiceStub(channels["draft"]),
    )


@pytest.fixture(scope="module")
def vocab(stubs) -> int:
    return stubs[1].GetModelInfo(target_pb2.GetModelInfoRequest(), timeout=60).vocab_size


def status_of(call, request, timeout: float = CALL_TIMEOUT) -> grpc.StatusCode:
    sent["requests"] += 1
    try:
        response = call(request, timeout=timeout)
        if not hasattr(response, "ByteSize"):
            for _ in response:
                pass
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def greedy_tokens(router) -> list[int]:
    request = router_pb2.GenerateRequest(
        prompt_token_ids=PROMPT_IDS,
        max_new_tokens=12,
        ignore_eos=True,
        sampling=common_pb2.SamplingParams(seed=1),
    )
    return [t for m in router.Generate(request, timeout=120) for t in m.token_ids]


@pytest.fixture(scope="module")
def before(stubs) -> list[int]:
    return greedy_tokens(stubs[0])


# -- the reported bugs, one by one ------------------------------------------------------------------------


def test_a_session_id_with_a_trailing_newline_is_refused(stubs) -> None:
    router, target, _ = stubs
    assert status_of(target.Release, target_pb2.ReleaseRequest(session_id="abc\n")) == INVALID
    request = router_pb2.GenerateRequest(prompt="hi", max_new_tokens=1, session_id="abc\n")
    assert status_of(router.Generate, request) == INVALID


@pytest.mark.parametrize("temperature", [math.inf, math.nan, 1e30])
def test_an_infinite_temperature_is_refused(stubs, temperature: float) -> None:
    request = router_pb2.GenerateRequest(
        prompt="hi", max_new_tokens=4, sampling=common_pb2.SamplingParams(temperature=temperature)
    )
    assert status_of(stubs[0].Generate, request) == INVALID


def test_a_huge_prompt_is_refused_before_it_is_tokenized(stubs) -> None:
    request = router_pb2.GenerateRequest(prompt="lorem ipsum " * 1_000_000, max_new_tokens=1)  # 12 MB
    start = time.perf_counter()
    assert status_of(stubs[0].Generate, request) == INVALID
    assert time.perf_counter() - start < 2.0  # tokenizing it took 6.75 s


@pytest.fixture
def target_session(stubs):
    target = stubs[1]
    response = target.Prefill(
        target_pb2.PrefillRequest(session_id="fuzz-target", token_ids=PROMPT_IDS, capacity=128), timeout=60
    )
    yield response
    target.Release(target_pb2.ReleaseRequest(session_id="fuzz-target"), timeout=60)


@pytest.mark.parametrize(
    ("token_ids", "probs"),
    [([5, 6], [1.0]), ([5], [math.nan]), ([5, 6], [-0.5, 1.5]), ([5], [1e30])],
    ids=["length-mismatch", "nan", "negative", "huge"],
)
def test_malformed_draft_probabilities_are_refused(stubs, target_session, token_ids, probs) -> None:
    tree = common_pb2.DraftTree(
        token_ids=[target_session.next_token, 5],
        parent_ids=[-1, 0],
        kind=common_pb2.CANDIDATE_KIND_SAMPLED,
        draft_probs=[common_pb2.SparseProbs(node=0, token_ids=token_ids, probs=probs)],
    )
    request = target_pb2.VerifyRequest(
        session_id="fuzz-target",
        tree=tree,
        committed_length=target_session.committed_length + 1,
    )
    assert status_of(stubs[1].Verify, request) == INVALID


@pytest.mark.parametrize("root", [-5, 49152, 2**31 - 1])
def test_a_rebuild_root_outside_the_vocabulary_is_refused(stubs, root: int) -> None:
    request = target_pb2.PrefillRequest(
        session_id="fuzz-rebuild", token_ids=PROMPT_IDS, root_token=root, capacity=128
    )
    assert status_of(stubs[1].Prefill, request) == INVALID


def test_a_rebuild_that_rewrites_another_sessions_history_is_refused(stubs, target_session) -> None:
    garbage = [7] * len(PROMPT_IDS)  # same length, other tokens
    request = target_pb2.PrefillRequest(
        session_id="fuzz-target", token_ids=garbage, root_token=target_session.next_token, capacity=128
    )
    assert status_of(stubs[1].Prefill, request) == grpc.StatusCode.FAILED_PRECONDITION


def test_draft_out_of_vocabulary_ids_and_foreign_targets_are_refused(stubs, shared_stack, vocab) -> None:
    draft = stubs[2]
    target = shared_stack.address("target")
    prefill = draft_pb2.DraftPrefillRequest(
        session_id="fuzz-draft", method="glide", token_ids=[1, vocab], target_address=target, capacity=128
    )
    assert status_of(draft.Prefill, prefill) == INVALID
    foreign = draft_pb2.DraftPrefillRequest(
        session_id="fuzz-draft",
        method="glide",
        token_ids=[1, 2],
        target_address="169.254.169.254:80",
        capacity=128,
    )
    assert status_of(draft.Prefill, foreign) == grpc.StatusCode.PERMISSION_DENIED
    propose = draft_pb2.ProposeRequest(session_id="fuzz-draft", new_token_ids=[-3])
    assert status_of(draft.Propose, propose) == INVALID


# -- requests that are not their message type, and huge values in error messages ------------------------

# Every service parses a request before any handler runs; these bytes fail that parse three ways.
TRUNCATED = b"z\x05ab"  # field 15, length-delimited, 5 bytes announced and 2 sent
BAD_WIRE_TYPE = b"\x0f\x00"  # field 1 with wire type 7, which does not exist
UNDECODABLE_RPCS = [  # (role, method path, request type, server-streaming)
    ("router", "/specserve.v1.RouterService/Generate", router_pb2.GenerateRequest, True),
    ("router", "/specserve.v1.RouterService/Cancel", router_pb2.CancelRequest, False),
    ("target", "/specserve.v1.TargetService/Prefill", target_pb2.PrefillRequest, False),
    ("target", "/specserve.v1.TargetService/StreamKV", target_pb2.StreamKVRequest, True),
    ("draft", "/specserve.v1.DraftService/Propose", draft_pb2.ProposeRequest, False),
    ("draft", "/specserve.v1.DraftService/Prefill", draft_pb2.DraftPrefillRequest, False),
]


def with_invalid_utf8(message_type) -> bytes:
    """A request whose first string field holds bytes that are not UTF-8."""
    field = next(f for f in message_type.DESCRIPTOR.fields if f.type == f.TYPE_STRING)
    return message_type(**{field.name: "@@"}).SerializeToString().replace(b"@@", b"\xff\xfe")


@pytest.mark.parametrize("damage", ["invalid-utf8", "truncated", "bad-wire-type"])
@pytest.mark.parametrize(("role", "path", "message_type", "streaming"), UNDECODABLE_RPCS, ids=lambda v: v)
def test_an_undecodable_request_gets_invalid_argument(
    channels, expect_status, damage, role, path, message_type, streaming
) -> None:
    raw = {
        "invalid-utf8": with_invalid_utf8(message_type),
        "truncated": TRUNCATED,
        "bad-wire-type": BAD_WIRE_TYPE,
    }
    channel = channels[role]
    call = channel.unary_stream(path) if streaming else channel.unary_unary(path)
    details = expect_status(INVALID, call, raw[damage])
    assert message_type.DESCRIPTOR.full_name in details and "could not be decoded" in details


HUGE = "m" * 1_000_000


@pytest.mark.parametrize(
    ("role", "method", "message"),
    [
        ("router", "Generate", router_pb2.GenerateRequest(prompt="hi", max_new_tokens=1, method=HUGE)),
        ("router", "Cancel", router_pb2.CancelRequest(session_id=HUGE)),
        ("target", "Release", target_pb2.ReleaseRequest(session_id=HUGE)),
        ("draft", "Prefill", draft_pb2.DraftPrefillRequest(session_id="fuzz-huge", method=HUGE, capacity=8)),
    ],
    ids=["router-method", "router-session-id", "target-session-id", "draft-method"],
)
def test_a_huge_value_gets_a_short_invalid_argument(stubs, expect_status, role, method, message) -> None:
    """The message quotes a short piece of the value: a 1 MB message would not fit gRPC's trailers (the
    client would see RESOURCE_EXHAUSTED about metadata size instead)."""
    details = expect_status(INVALID, getattr(stubs[ROLE_INDEX[role]], method), message)
    assert "mmmm" in details and len(details) <= MAX_MESSAGE_CHARS


# -- Hypothesis over every RPC's request ----------------------------------------------------------------

ids = st.one_of(st.integers(-5, 60_000), st.sampled_from([-(2**31), 2**31 - 1, 49151, 49152]))
session_ids = st.one_of(st.text(max_size=70), st.sampled_from(["fuzz-target", "fuzz-a", "a\n", ""]))
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
sampling = st.builds(
    common_pb2.SamplingParams,
    temperature=floats,
    top_p=floats,
    top_k=st.integers(-(2**31), 2**31 - 1),
    seed=st.integers(0, 2**64 - 1),
)
sparse = st.builds(
    common_pb2.SparseProbs,
    node=st.integers(-3, 8),
    token_ids=st.lists(ids, max_size=6),
    probs=st.lists(floats, max_size=6),
)
trees = st.builds(
    common_pb2.DraftTree,
    token_ids=st.lists(ids, max_size=10),
    parent_ids=st.lists(st.integers(-3, 10), max_size=10),
    kind=st.integers(0, 4),
    draft_probs=st.lists(sparse, max_size=3),
)
REQUESTS = {
    ("router", "Generate"): st.builds(
        router_pb2.GenerateRequest,
        prompt=st.text(max_size=40),
        prompt_token_ids=st.lists(ids, max_size=8),
        sampling=sampling,
        max_new_tokens=st.integers(-3, 10_000),
        stop=st.lists(st.text(max_size=300), max_size=20),
        method=st.sampled_from(["", "glide", "target", "hf", "nope"]),
        session_id=session_ids,
    ),
    ("router", "Resume"): st.builds(
        router_pb2.ResumeRequest, session_id=session_ids, received_tokens=st.integers(-(2**31), 2**31 - 1)
    ),
    ("router", "Cancel"): st.builds(router_pb2.CancelRequest, session_id=session_ids),
    ("target", "Prefill"): st.builds(
        target_pb2.PrefillRequest,
        session_id=session_ids,
        token_ids=st.lists(ids, max_size=8),
        root_token=ids,
        capacity=st.integers(-5, 5000),
        sampling=sampling,
        step_seed=st.integers(0, 2**64 - 1),
    ),
    ("target", "Verify"): st.builds(
        target_pb2.VerifyRequest,
        session_id=session_ids,
        tree=trees,
        committed_length=st.integers(-5, 40),
        step_seed=st.integers(0, 2**64 - 1),
    ),
    ("target", "StreamKV"): st.builds(
        target_pb2.StreamKVRequest,
        session_id=session_ids,
        from_position=st.integers(-5, 5000),
        layers=st.lists(st.integers(-3, 100), max_size=4),
    ),
    ("target", "Release"): st.builds(target_pb2.ReleaseRequest, session_id=session_ids),
    ("draft", "Prefill"): st.builds(
        draft_pb2.DraftPrefillRequest,
        session_id=session_ids,
        method=st.sampled_from(["", "glide", "glide-cape", "vanilla", "target", "x"]),
        token_ids=st.lists(ids, max_size=8),
        target_address=st.sampled_from(["", "localhost:1", "example.com:443"]),
        capacity=st.integers(-5, 5000),
        request_seed=st.integers(0, 2**64 - 1),
        sampling=sampling,
    ),
    ("draft", "Propose"): st.builds(
        draft_pb2.ProposeRequest,
        session_id=session_ids,
        from_position=st.integers(-5, 50),
        new_token_ids=st.lists(ids, max_size=8),
        step_seed=st.integers(0, 2**64 - 1),
    ),
    ("draft", "Release"): st.builds(draft_pb2.DraftReleaseRequest, session_id=session_ids),
}
ROLE_INDEX = {"router": 0, "target": 1, "draft": 2}


@pytest.mark.parametrize(("role", "method"), list(REQUESTS), ids=lambda v: v)
def test_fuzzed_requests_never_get_internal(stubs, target_session, before, role: str, method: str) -> None:
    call = getattr(stubs[ROLE_INDEX[role]], method)
    seen: dict[grpc.StatusCode, int] = {}

    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(request=REQUESTS[(role, method)])
    def check(request) -> None:
        if role == "router" and method == "Generate":
            # bounded work per example (0 would ask for the router's default limit, 1024)
            request.max_new_tokens = min(request.max_new_tokens, 4) or 4
        # A feed on a live session streams until its deadline (DEADLINE_EXCEEDED): keep that short.
        code = status_of(call, request, 3.0 if method == "StreamKV" else CALL_TIMEOUT)
        seen[code] = seen.get(code, 0) + 1
        assert code in DOCUMENTED, f"{role}.{method} -> {code} for {request!r}"

    check()
    assert sum(seen.values()) >= FUZZ_EXAMPLES // 2


def test_after_the_fuzzing_everything_serves_and_output_is_unchanged(stubs, channels, before) -> None:
    for channel in channels.values():
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert greedy_tokens(stubs[0]) == before
    print(f"\nfuzzing: {sent['requests']} requests sent, 0 INTERNAL")
