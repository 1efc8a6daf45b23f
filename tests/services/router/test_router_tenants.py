"""Tenants (bearer tokens) cannot learn which session ids other tenants use: another tenant's id is
answered exactly as an id nobody uses (Resume, Cancel), and Generate with it starts a session of the
caller's own, which never touches the other's. Over real gRPC, a router with two tokens in front of the
shared stack."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from router_process import router_env, router_process

from specserve.v1 import router_pb2, router_pb2_grpc

pytestmark = [pytest.mark.distributed, pytest.mark.model, pytest.mark.timeout(240)]

TOKENS = {"alice": "tenant-token-alice", "bob": "tenant-token-bob"}
ALICES_ID = "alices-session-0001"
UNKNOWN_ID = "nobodys-session-0001"
TIMEOUT = 120


@pytest.fixture(scope="module")
def router(shared_stack, tmp_path_factory) -> Iterator[str]:
    env = router_env(shared_stack, auth_tokens=",".join(TOKENS.values()))
    with router_process(env, tmp_path_factory.mktemp("tenants") / "router.log"):
        yield f"localhost:{env['SPECSERVE_ROUTER_PORT']}"


@pytest.fixture(scope="module")
def stub(router: str) -> Iterator[router_pb2_grpc.RouterServiceStub]:
    with grpc.insecure_channel(router) as channel:
        yield router_pb2_grpc.RouterServiceStub(channel)


def as_(tenant: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {TOKENS[tenant]}")]


def generate(stub, tenant: str, session_id: str, prompt: str) -> list[router_pb2.GenerateResponse]:
    request = router_pb2.GenerateRequest(
        prompt=prompt, max_new_tokens=4, method="target", session_id=session_id, ignore_eos=True
    )
    return list(stub.Generate(request, metadata=as_(tenant), timeout=TIMEOUT))


def failure(call, request, tenant: str) -> tuple[grpc.StatusCode, str]:
    try:
        response = call(request, metadata=as_(tenant), timeout=TIMEOUT)
        if not hasattr(response, "ByteSize"):
            list(response)
    except grpc.RpcError as e:
        return e.code(), e.details()
    raise AssertionError(f"{request!r} succeeded")


def test_another_tenants_session_id_is_answered_as_an_unknown_one(stub) -> None:
    alices = generate(stub, "alice", ALICES_ID, "Name a colour.")
    for name, call, request in [
        ("Resume", stub.Resume, lambda sid: router_pb2.ResumeRequest(session_id=sid)),
        ("Cancel", stub.Cancel, lambda sid: router_pb2.CancelRequest(session_id=sid)),
    ]:
        code, details = failure(call, request(ALICES_ID), "bob")
        unknown_code, unknown_details = failure(call, request(UNKNOWN_ID), "bob")
        assert code == unknown_code == grpc.StatusCode.NOT_FOUND, name
        assert details.replace(ALICES_ID, "ID") == unknown_details.replace(UNKNOWN_ID, "ID"), name
    # Bob's Generate with Alice's id is a session of Bob's own: no refusal, and Alice's is untouched.
    bobs = generate(stub, "bob", ALICES_ID, "Name an animal.")
    assert bobs[-1].session_id == ALICES_ID and bobs[-1].stats.num_generated_tokens == 4
    resumed = list(
        stub.Resume(router_pb2.ResumeRequest(session_id=ALICES_ID), metadata=as_("alice"), timeout=TIMEOUT)
    )
    assert [t for m in resumed for t in m.token_ids] == [t for m in alices for t in m.token_ids]
    assert "".join(m.text for m in resumed) == "".join(m.text for m in alices)
    bobs_again = list(
        stub.Resume(router_pb2.ResumeRequest(session_id=ALICES_ID), metadata=as_("bob"), timeout=TIMEOUT)
    )
    assert "".join(m.text for m in bobs_again) == "".join(m.text for m in bobs)
    # Each tenant's own id still collides with itself, and cancels only its own.
    code, details = failure(
        stub.Generate,
        router_pb2.GenerateRequest(prompt="Hi.", max_new_tokens=2, method="target", session_id=ALICES_ID),
        "bob",
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "already exists" in details
    stub.Cancel(router_pb2.CancelRequest(session_id=ALICES_ID), metadata=as_("bob"), timeout=TIMEOUT)
    assert list(
        stub.Resume(router_pb2.ResumeRequest(session_id=ALICES_ID), metadata=as_("alice"), timeout=TIMEOUT)
    )
    stub.Cancel(router_pb2.CancelRequest(session_id=ALICES_ID), metadata=as_("alice"), timeout=TIMEOUT)
