"""A request that names no token limit gets the router's default cap (SPECSERVE_ROUTER_DEFAULT_MAX_TOKENS),
over HTTP (no `max_tokens`) and gRPC (`max_new_tokens` 0), so it cannot run to the context's end."""

from __future__ import annotations

import grpc
import openai
import pytest
from router_process import router_env, router_process

from specserve.errors import InvalidArgument
from specserve.serving.settings import RouterServiceSettings
from specserve.serving.stack import free_port
from specserve.v1 import common_pb2, router_pb2, router_pb2_grpc

DEFAULT_MAX_TOKENS = 3
PROMPT = "Tell me a long story about the sea."


def test_the_default_cap_is_a_setting() -> None:
    assert RouterServiceSettings.from_env({}).default_max_tokens == 1024
    assert (
        RouterServiceSettings.from_env({"SPECSERVE_ROUTER_DEFAULT_MAX_TOKENS": "7"}).default_max_tokens == 7
    )
    with pytest.raises(InvalidArgument, match="default_max_tokens"):
        RouterServiceSettings.from_env({"SPECSERVE_ROUTER_DEFAULT_MAX_TOKENS": "0"})


@pytest.mark.distributed
@pytest.mark.model
@pytest.mark.timeout(300)
def test_requests_without_a_limit_stop_at_the_default(shared_stack, tmp_path) -> None:
    env = router_env(shared_stack, http_port=free_port(), default_max_tokens=DEFAULT_MAX_TOKENS)
    with router_process(env, tmp_path / "router.log"):
        client = openai.OpenAI(
            base_url=f"http://localhost:{env['SPECSERVE_ROUTER_HTTP_PORT']}/v1", api_key="-", max_retries=0
        )
        messages = [{"role": "user", "content": PROMPT}]
        chat = client.chat.completions.create(
            model="", messages=messages, temperature=0, extra_body={"ignore_eos": True}
        )
        assert chat.usage.completion_tokens == DEFAULT_MAX_TOKENS
        assert chat.choices[0].finish_reason == "length"
        completion = client.completions.create(model="", prompt=PROMPT, extra_body={"ignore_eos": True})
        assert completion.usage.completion_tokens == DEFAULT_MAX_TOKENS
        # A limit the request names is its own, above the default too.
        named = client.completions.create(
            model="", prompt=PROMPT, max_tokens=5, extra_body={"ignore_eos": True}
        )
        assert named.usage.completion_tokens == 5

        with grpc.insecure_channel(f"localhost:{env['SPECSERVE_ROUTER_PORT']}") as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)
            request = router_pb2.GenerateRequest(prompt=PROMPT, ignore_eos=True)  # max_new_tokens 0: unnamed
            *_, last = stub.Generate(request, timeout=120)
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert last.stats.num_generated_tokens == DEFAULT_MAX_TOKENS
