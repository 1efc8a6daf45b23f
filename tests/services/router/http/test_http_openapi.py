"""The served OpenAPI document says what the API does, in process (no stack: the document and the routing
need no model). Each case here is one schemathesis found against the real API
(test_http_schemathesis.py): a status the document did not declare, a 405 without its `Allow` header, or
a body the document called valid that the API refuses for a reason that does not depend on the model.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest
from starlette.testclient import TestClient

from services.router.http.app import create_app
from services.router.http.body import parse
from services.router.http.errors import HttpError
from services.router.http.schemas import ChatCompletionRequest, CompletionRequest
from specserve.catalog import MethodSupport
from specserve.core.request import GenerationRequest, InvalidField
from specserve.serving.settings import RouterServiceSettings
from specserve.v1 import target_pb2

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "hi"}


# What a router knows of its model and methods when it serves the document (the rest of RouterServicer
# is not needed to build it).
MODEL = target_pb2.ModelInfo(
    model_name="tiny",
    vocab_size=100,
    max_new_tokens_limit=4096,
    max_prompt_tokens=1536,
    max_context=8192,
    supports_logprobs=True,
)
METHODS = frozenset({"target", "eagle-cape-suffix", "mcsd"})


def router(**model: Any) -> SimpleNamespace:
    info = target_pb2.ModelInfo()
    info.CopyFrom(MODEL)
    for name, value in model.items():
        setattr(info, name, value)
    return SimpleNamespace(
        settings=RouterServiceSettings(),
        model=info,
        methods=METHODS,
        method_support=MethodSupport(in_process=False),
    )


def document(secured: bool = True, **model: Any) -> dict[str, Any]:
    return create_app(router(**model), secured).openapi()


def body_validator(model: type) -> jsonschema.Validator:
    served = document()
    return jsonschema.Draft202012Validator(
        {"$ref": f"#/components/schemas/{model.__name__}", "components": served["components"]}
    )


def refused_by_the_api(model: type, body: dict) -> bool:
    """True when the API refuses `body` (400) before the model is involved."""
    try:
        parsed = parse(json.dumps(body).encode(), model)
    except HttpError as e:
        return e.status == 400
    if model is ChatCompletionRequest and not any(m.text.strip() for m in parsed.messages):
        return True  # what the router's tokenizer refuses before it runs the chat template
    try:  # the bounds every request meets, whatever the model (no limits given)
        GenerationRequest.build(
            method="target",
            temperature=1.0 if parsed.temperature is None else parsed.temperature,
            top_p=1.0 if parsed.top_p is None else parsed.top_p,
            top_k=parsed.top_k or 0,
            stop=parsed.stop_strings,
            seed=parsed.seed,
        )
    except InvalidField:
        return True
    return False


STATIC_REFUSALS = [
    pytest.param(
        ChatCompletionRequest,
        {
            "messages": [
                {"role": "system", "content": " "},
                {"role": "user", "content": [{"type": "text", "text": ""}]},
            ]
        },
        id="blank-chat",
    ),
    pytest.param(
        ChatCompletionRequest,
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                },
                {"role": "user", "content": ""},
            ]
        },
        id="calls-and-a-blank",
    ),
    pytest.param(CompletionRequest, COMPLETION | {"best_of": 0}, id="best-of-0"),
    pytest.param(CompletionRequest, COMPLETION | {"echo": True}, id="echo"),
    pytest.param(CompletionRequest, COMPLETION | {"suffix": "x"}, id="suffix"),
    pytest.param(CompletionRequest, {"prompt": ["a", "b"]}, id="prompt-batch"),
    pytest.param(ChatCompletionRequest, CHAT | {"top_logprobs": 19, "logprobs": False}, id="top-logprobs"),
    pytest.param(
        ChatCompletionRequest, CHAT | {"stream_options": {"include_usage": True}}, id="stream-options"
    ),
    pytest.param(ChatCompletionRequest, CHAT | {"n": 2}, id="n"),
    pytest.param(ChatCompletionRequest, CHAT | {"presence_penalty": 0.5}, id="presence-penalty"),
    pytest.param(ChatCompletionRequest, CHAT | {"logit_bias": {"42": 1.0}}, id="logit-bias"),
    pytest.param(ChatCompletionRequest, CHAT | {"temperature": 100.5}, id="temperature"),
    pytest.param(ChatCompletionRequest, CHAT | {"top_p": 0}, id="top-p"),
    pytest.param(ChatCompletionRequest, CHAT | {"top_k": -1}, id="top-k"),
    pytest.param(ChatCompletionRequest, CHAT | {"seed": 2**63}, id="seed"),
    pytest.param(ChatCompletionRequest, CHAT | {"stop": ["x"] * 17}, id="stop-count"),
    pytest.param(ChatCompletionRequest, CHAT | {"stop": ""}, id="stop-empty"),
    pytest.param(ChatCompletionRequest, {"messages": [{"role": "user"}]}, id="no-content"),
    pytest.param(
        ChatCompletionRequest, {"messages": [{"role": "tool", "content": "1"}]}, id="tool-without-call-id"
    ),
    pytest.param(
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": "hi", "tool_call_id": "c"}]},
        id="call-id-not-from-a-tool",
    ),
    pytest.param(
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": "hi", "tool_calls": []}]},
        id="calls-not-from-the-assistant",
    ),
    pytest.param(
        ChatCompletionRequest, CHAT | {"response_format": {"type": "json_schema"}}, id="no-json-schema"
    ),
    pytest.param(
        ChatCompletionRequest, CHAT | {"structured_outputs": {"regex": "a", "grammar": "b"}}, id="two-kinds"
    ),
    pytest.param(CompletionRequest, COMPLETION | {"structured_outputs": {"regex": None}}, id="null-kind"),
]


@pytest.mark.parametrize(("model", "body"), STATIC_REFUSALS)
def test_what_the_api_refuses_whatever_the_model_the_document_calls_invalid(model: type, body: dict) -> None:
    assert refused_by_the_api(model, body)
    assert not body_validator(model).is_valid(body)


ACCEPTED = [
    pytest.param(CompletionRequest, COMPLETION, id="completion"),
    pytest.param(CompletionRequest, {"prompt": [1, 2, 3], "best_of": 1, "echo": False}, id="token-ids"),
    pytest.param(
        ChatCompletionRequest,
        CHAT
        | {"stream": True, "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 3},
        id="stream-with-usage-and-logprobs",
    ),
    pytest.param(
        ChatCompletionRequest,
        CHAT | {"temperature": 0, "top_p": 1, "top_k": 0, "seed": 0, "stop": ["\n"], "n": 1},
        id="sampling-at-bounds",
    ),
    pytest.param(
        ChatCompletionRequest,
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c", "content": "sunny"},
            ],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "tool_choice": "required",
            "parallel_tool_calls": False,
        },
        id="tools",
    ),
    pytest.param(
        ChatCompletionRequest,
        CHAT | {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}},
        id="json-schema",
    ),
    pytest.param(CompletionRequest, COMPLETION | {"structured_outputs": {"choice": ["a"]}}, id="choice"),
]


@pytest.mark.parametrize(("model", "body"), ACCEPTED)
def test_what_the_api_accepts_the_document_calls_valid(model: type, body: dict) -> None:
    assert not refused_by_the_api(model, body)
    assert body_validator(model).is_valid(body)


def test_every_status_a_route_answers_is_declared() -> None:
    paths = document()["paths"]
    assert "404" in paths["/v1/models/{model_id}"]["get"]["responses"]  # an unknown model id
    for path in ("/v1/models", "/v1/models/{model_id}", "/v1/methods", "/v1/chat/completions"):
        (operation,) = paths[path].values()
        assert "401" in operation["responses"] and operation["security"] == [{"bearer": []}]
    for path in ("/", "/health"):  # open: no token asked
        assert "401" not in paths[path]["get"]["responses"] and "security" not in paths[path]["get"]


def test_without_tokens_the_document_asks_for_none() -> None:
    served = document(secured=False)
    assert "securitySchemes" not in served["components"]
    for operations in served["paths"].values():
        for operation in operations.values():
            assert "401" not in operation["responses"] and "security" not in operation


def test_a_method_a_path_does_not_take_gets_405_with_allow() -> None:
    client = TestClient(create_app(SimpleNamespace(settings=RouterServiceSettings()), False))
    for method, path, allowed in [
        ("DELETE", "/v1/models", "GET"),
        ("PUT", "/v1/chat/completions", "POST"),
        ("POST", "/health", "GET"),
    ]:
        response = client.request(method, path)
        assert response.status_code == 405
        assert response.headers["allow"] == allowed  # RFC 9110: a 405 names the methods that work
        assert response.json()["error"]["code"] == "method_not_allowed"


def test_the_document_states_the_served_models_bounds() -> None:
    chat = body_validator(ChatCompletionRequest)
    completion = body_validator(CompletionRequest)
    limit = MODEL.max_new_tokens_limit
    for field in ("max_tokens", "max_completion_tokens"):
        assert chat.is_valid(CHAT | {field: limit}) and not chat.is_valid(CHAT | {field: limit + 1})
    assert not chat.is_valid(CHAT | {"method": "no-such-method"}) and chat.is_valid(
        CHAT | {"method": "target"}
    )
    assert chat.is_valid(CHAT | {"method": "glide+cape+svip+suffix"})  # a method named by its axes
    assert not chat.is_valid(CHAT | {"method": "vanilla+mcsd-target"})  # in process only
    assert not chat.is_valid(CHAT | {"model": "another"}) and chat.is_valid(CHAT | {"model": "tiny"})
    assert completion.is_valid({"prompt": [MODEL.vocab_size - 1]})
    assert not completion.is_valid({"prompt": [MODEL.vocab_size]})
    assert not document(supports_logprobs=False)["components"]["schemas"]["CompletionRequest"]["properties"][
        "logprobs"
    ].get("anyOf")


@pytest.mark.parametrize(
    ("model", "body"),
    [
        (ChatCompletionRequest, CHAT | {"max_tokens": 1.0, "seed": 1e2, "n": 1.0, "top_k": 4.0}),
        (ChatCompletionRequest, CHAT | {"max_completion_tokens": 2e1, "logprobs": True, "top_logprobs": 2.0}),
        (CompletionRequest, {"prompt": [1.0, 2e0], "logprobs": 1.0, "best_of": 1.0}),
    ],
)
def test_integral_numbers_are_integers_as_the_document_says(model: type, body: dict) -> None:
    assert body_validator(model).is_valid(body)  # JSON Schema: 1.0 and 1e2 are integers
    assert not refused_by_the_api(model, body)


@pytest.mark.parametrize("value", [1.5, True, "1"])
def test_numbers_with_a_fraction_and_other_types_are_not_integers(value: object) -> None:
    assert not body_validator(CompletionRequest).is_valid({"prompt": "hi", "max_tokens": value})
    assert refused_by_the_api(CompletionRequest, {"prompt": "hi", "max_tokens": value})
