"""RouterService answers bad requests with the status code the API promises, over real gRPC.

Generate and Resume are server streams: the status arrives while iterating, before any token.
"""

from __future__ import annotations

import grpc
import pytest

from specserve.v1 import common_pb2, router_pb2, router_pb2_grpc, target_pb2, target_pb2_grpc

pytestmark = [pytest.mark.distributed, pytest.mark.model, pytest.mark.timeout(240)]

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND


@pytest.fixture(scope="module")
def stub(channels) -> router_pb2_grpc.RouterServiceStub:
    return router_pb2_grpc.RouterServiceStub(channels["router"])


@pytest.fixture(scope="module")
def info(channels) -> target_pb2.ModelInfo:
    """The bounds the router enforces are the target's."""
    return target_pb2_grpc.TargetServiceStub(channels["target"]).GetModelInfo(
        target_pb2.GetModelInfoRequest(), timeout=60
    )


def generate(info: target_pb2.ModelInfo, **overrides) -> router_pb2.GenerateRequest:
    fields = {"prompt": "Say hi.", "max_new_tokens": 4, "method": "target"} | overrides
    fields = {k: v(info) if callable(v) else v for k, v in fields.items()}
    return router_pb2.GenerateRequest(**fields)


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"prompt_token_ids": [1, 2, 3]}, id="both-prompt-fields"),
        pytest.param({"prompt": ""}, id="neither-prompt-field"),
        pytest.param({"prompt": "  \n "}, id="blank-prompt"),
        pytest.param({"method": "no-such-method"}, id="unknown-method"),
        pytest.param({"method": "hf"}, id="in-process-only-method"),
        pytest.param({"method": "mcsd-target-init"}, id="method-not-served-remotely"),
        pytest.param({"sampling": common_pb2.SamplingParams(temperature=-0.5)}, id="temperature-below-0"),
        pytest.param({"sampling": common_pb2.SamplingParams(top_p=1.5)}, id="top-p-above-1"),
        pytest.param({"sampling": common_pb2.SamplingParams(top_k=-1)}, id="top-k-below-0"),
        pytest.param({"max_new_tokens": -3}, id="max-new-tokens-negative"),
        pytest.param(
            {"max_new_tokens": lambda info: info.max_new_tokens_limit + 1}, id="max-new-tokens-above-limit"
        ),
        pytest.param(
            {"prompt": "", "prompt_token_ids": lambda info: [42] * (info.max_prompt_tokens + 1)},
            id="prompt-ids-above-max-prompt-tokens",
        ),
        pytest.param(
            {"prompt": lambda info: "word " * (info.max_prompt_tokens + 10)},
            id="prompt-text-above-max-prompt-tokens",
        ),
        pytest.param(
            {"prompt": "", "prompt_token_ids": lambda info: [1, info.vocab_size]}, id="token-outside-vocab"
        ),
        pytest.param(
            {
                "prompt": "",
                "prompt_token_ids": lambda info: [42] * info.max_prompt_tokens,
                "max_new_tokens": lambda info: info.max_context,
            },
            id="prompt-plus-new-tokens-above-context",
        ),
        pytest.param({"stop": ["x"] * 17}, id="too-many-stop-strings"),
        pytest.param({"stop": [""]}, id="empty-stop-string"),
        pytest.param({"session_id": "not ok"}, id="bad-session-id"),
    ],
)
def test_generate_rejects_bad_requests_with_invalid_argument(stub, info, expect_status, overrides):
    expect_status(INVALID, stub.Generate, generate(info, **overrides))


def test_generate_with_a_session_id_in_use_is_invalid_argument(stub, info, expect_status):
    first = list(
        stub.Generate(generate(info, session_id="router-status-reused", max_new_tokens=2), timeout=60)
    )
    assert first[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
    details = expect_status(INVALID, stub.Generate, generate(info, session_id="router-status-reused"))
    assert "already exists" in details
    stub.Cancel(router_pb2.CancelRequest(session_id="router-status-reused"), timeout=60)


def test_resume_and_cancel_of_an_unknown_session_are_not_found(stub, expect_status):
    expect_status(NOT_FOUND, stub.Resume, router_pb2.ResumeRequest(session_id="never-started"))
    expect_status(NOT_FOUND, stub.Cancel, router_pb2.CancelRequest(session_id="never-started"))


def test_resume_and_cancel_with_a_bad_session_id_are_invalid_argument(stub, expect_status):
    expect_status(INVALID, stub.Resume, router_pb2.ResumeRequest(session_id="a/b"))
    expect_status(INVALID, stub.Cancel, router_pb2.CancelRequest(session_id=""))


def test_list_methods_names_only_methods_the_router_serves(stub):
    names = {m.name for m in stub.ListMethods(router_pb2.ListMethodsRequest(), timeout=60).methods}
    assert {"target", "glide", "glide-cape"} <= names
    assert not {"hf", "mcsd-target-init"} & names
