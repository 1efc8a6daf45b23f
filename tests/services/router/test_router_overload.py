"""A router at its concurrency limit refuses the next RPC with RESOURCE_EXHAUSTED at once (no queue).

A second router process with SPECSERVE_ROUTER_MAX_CONCURRENT_RPCS=1 shares the shared stack's target,
draft and Redis: while one Generate streams, a second is refused; once the first ends, it is served.
"""

from __future__ import annotations

import time

import grpc
import pytest
from router_process import router_env, router_process

from specserve.v1 import common_pb2, router_pb2, router_pb2_grpc

pytestmark = [pytest.mark.distributed, pytest.mark.model]

PROMPT = "Name the planets of the solar system."


@pytest.fixture(scope="module")
def limited_router(shared_stack, tmp_path_factory):
    env = router_env(shared_stack, max_concurrent_rpcs=1)
    with router_process(env, tmp_path_factory.mktemp("limited-router") / "router.log"):
        yield f"localhost:{env['SPECSERVE_ROUTER_PORT']}"


def request(max_new_tokens: int) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        prompt=PROMPT,
        max_new_tokens=max_new_tokens,
        ignore_eos=True,
        method="glide",
        sampling=common_pb2.SamplingParams(temperature=0.0),
    )


@pytest.mark.timeout(180)
def test_second_concurrent_generate_is_resource_exhausted(limited_router):
    with grpc.insecure_channel(limited_router) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        first = stub.Generate(request(32), timeout=120)
        received = list(next(first).token_ids)  # the first RPC is now streaming
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(request(4), timeout=30))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()

        # The refusal did not disturb the running stream ...
        messages = list(first)
        received += [t for m in messages for t in m.token_ids]
        assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert len(received) == 32
        # ... and with it finished, the slot is free again (the server frees it just after the status).
        assert generate_when_free(stub)[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


def generate_when_free(stub: router_pb2_grpc.RouterServiceStub) -> list[router_pb2.GenerateResponse]:
    deadline = time.monotonic() + 5
    while True:
        try:
            return list(stub.Generate(request(4), timeout=60))
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            time.sleep(0.1)
