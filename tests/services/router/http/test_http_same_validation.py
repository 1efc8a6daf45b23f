"""One request type, validated once: the in-process engine, the router's gRPC API and its HTTP API refuse
the same bad input with the same message (INVALID_ARGUMENT, HTTP 400), because all three build it with
GenerationRequest.build."""

from __future__ import annotations

import openai
import pytest

from specserve.client import Client
from specserve.core.request import GenerationRequest
from specserve.errors import InvalidArgument

pytestmark = [pytest.mark.distributed, pytest.mark.model]

PROMPT = "Say hi."

# (the request's fields, the same as HTTP body fields): each out of one bound
BAD = [
    pytest.param({"temperature": -1.0}, {"temperature": -1.0}, id="temperature"),
    pytest.param({"top_p": 1.5}, {"top_p": 1.5}, id="top-p"),
    pytest.param({"top_k": -2}, {"top_k": -2}, id="top-k"),
    pytest.param({"max_new_tokens": 5000}, {"max_tokens": 5000}, id="max-new-tokens"),
    pytest.param({"stop": ["x"] * 17}, {"stop": ["x"] * 17}, id="stop-strings"),
    pytest.param({"seed": 2**63}, {"seed": 2**63}, id="seed"),
    pytest.param({"method": "no-such-method"}, {"method": "no-such-method"}, id="method"),
]


def engine_error(engine, fields: dict) -> str:
    with pytest.raises(InvalidArgument) as raised:
        engine.generate(
            PROMPT, GenerationRequest.build(**({"method": "target", "max_new_tokens": 4} | fields))
        )
    return str(raised.value)


def grpc_error(http_router, fields: dict) -> str:
    options = {"method": "target", "max_new_tokens": 4} | fields
    with (
        Client(http_router.grpc_address, token=http_router.token) as sdk,
        pytest.raises(InvalidArgument) as raised,
    ):
        sdk.generate(PROMPT, timeout=60, **options)
    return str(raised.value)


def http_error(http_router, body: dict) -> str:
    client = openai.OpenAI(
        base_url=http_router.base_url, api_key=http_router.token, max_retries=0, timeout=60
    )
    fields = {"method": "target", "max_tokens": 4, "temperature": 0} | body
    extra = {k: fields.pop(k) for k in ("method", "top_k") if k in fields}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model="", messages=[{"role": "user", "content": PROMPT}], extra_body=extra, **fields
        )
    assert raised.value.status_code == 400 and raised.value.body["type"] == "invalid_request_error"
    return raised.value.body["message"]


@pytest.mark.parametrize(("fields", "body"), BAD)
def test_engine_grpc_and_http_refuse_alike(default_engine, http_router, fields, body) -> None:
    in_process = engine_error(default_engine, fields)
    over_grpc = grpc_error(http_router, fields)
    over_http = http_error(http_router, body)
    if "method" in fields:  # each lists the methods it runs: the engine runs the in-process ones too
        assert in_process.split(";")[0] == over_grpc.split(";")[0] == over_http.split(";")[0]
        assert "hf" in in_process and "hf" not in over_grpc
    else:
        assert in_process == over_grpc == over_http
