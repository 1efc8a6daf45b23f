"""The target's prefix cache over gRPC: a Prefill reports the prompt tokens it took from the cache, per
tenant (PrefillRequest.tenant, which the router sets from the authenticated caller), and answers as a
cold Prefill does. Over real gRPC on the shared stack's target, called as the router calls it."""

from __future__ import annotations

import pytest

from specserve.v1 import common_pb2, target_pb2

pytestmark = [pytest.mark.distributed, pytest.mark.model, pytest.mark.timeout(240)]

CHUNK = 256  # the stack target's prefill chunk
DOCUMENT = [1000 + (37 * i) % 20000 for i in range(2 * CHUNK + 40)]  # 552 tokens no other test sends
CAPACITY = 1024


@pytest.fixture(scope="module")
def shared(stub) -> int:
    """The tokens of DOCUMENT a later prompt finds cached: its whole blocks, as the replica publishes them
    (its prefill chunk, or 32 tokens on the file's own weights and the CPU's kernels)."""
    block = stub.GetModelInfo(target_pb2.GetModelInfoRequest(), timeout=60).prefix_cache_block_tokens
    assert block in (32, CHUNK)
    return len(DOCUMENT) // block * block


def prefill(stub, session_id: str, token_ids: list[int], tenant: str) -> target_pb2.PrefillResponse:
    request = target_pb2.PrefillRequest(
        session_id=session_id,
        token_ids=token_ids,
        capacity=CAPACITY,
        sampling=common_pb2.SamplingParams(),
        tenant=tenant,
    )
    try:
        return stub.Prefill(request, timeout=60)
    finally:
        stub.Release(target_pb2.ReleaseRequest(session_id=session_id), timeout=60)


def test_a_prefill_reuses_its_tenants_prefix_and_no_one_elses(stub, shared) -> None:
    first = prefill(stub, "prefix-a-1", [*DOCUMENT, 5], tenant="tenant-a")
    assert first.cached_tokens == 0
    again = prefill(stub, "prefix-a-2", [*DOCUMENT, 6], tenant="tenant-a")
    assert again.cached_tokens == shared
    other = prefill(stub, "prefix-b-1", [*DOCUMENT, 6], tenant="tenant-b")
    assert other.cached_tokens == 0  # the same tokens from another tenant: computed, not read
    assert other.next_token == again.next_token  # and the cached prefix answered as a cold one


def test_a_rebuild_reuses_the_prefix_too(stub, shared) -> None:
    prefill(stub, "prefix-r-1", [*DOCUMENT, 7], tenant="tenant-r")
    request = target_pb2.PrefillRequest(
        session_id="prefix-r-2",
        token_ids=[*DOCUMENT, 7],
        root_token=8,
        capacity=CAPACITY,
        sampling=common_pb2.SamplingParams(),
        tenant="tenant-r",
    )
    try:
        response = stub.Prefill(request, timeout=60)
    finally:
        stub.Release(target_pb2.ReleaseRequest(session_id="prefix-r-2"), timeout=60)
    assert response.cached_tokens == shared
    assert response.committed_length == len(DOCUMENT) + 1
