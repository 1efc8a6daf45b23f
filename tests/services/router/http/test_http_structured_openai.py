"""Structured output end to end: the official `openai` client against a real router in front of the real
stack (the shared fixtures of conftest.py). A json_schema answer is JSON valid against its schema and,
greedy, the same under speculation as from the target alone; tool_choice required answers with valid
tool_calls, and a streamed call assembles to the same arguments; the other languages (structured_outputs)
hold; a schema the engine cannot compile is a 400 naming response_format; the gRPC SDK takes a
constraint too.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from specserve.client import Client, Constraint, ConstraintKind
from specserve.grammar.schema import json_schema_constraint

pytestmark = [pytest.mark.distributed, pytest.mark.model]

METHOD = "glide"  # a draft model: forced tokens and the draft's both take part
MAX_TOKENS = 64
TIMEOUT_SECONDS = 180
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population": {"type": "integer", "minimum": 0},
    },
    "required": ["city", "country", "population"],
    "additionalProperties": False,
}
CITY_PROMPT = "Give the largest city of France, its country and its population, as JSON."
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
WEATHER_PROMPT = "What is the weather in Paris, in celsius?"


@pytest.fixture(scope="module")
def client(http_router) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=http_router.base_url, api_key=http_router.token, max_retries=0, timeout=TIMEOUT_SECONDS
    )


def chat(client: openai.OpenAI, prompt: str, method: str = METHOD, **kwargs):
    return client.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"method": method, **kwargs.pop("extra_body", {})},
        **kwargs,
    )


def test_json_schema_answers_are_valid_and_lossless_under_speculation(client) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    speculative = chat(client, CITY_PROMPT, response_format=response_format)
    answer = speculative.choices[0].message.content
    jsonschema.validate(json.loads(answer), CITY)
    assert speculative.choices[0].finish_reason == "stop"
    stats = speculative.usage.model_extra["specserve"]
    # the schema's fixed parts ('{"city": "', '", "country": "', ...) were forced: free drafts
    assert 0 < stats["num_forced_accepted_tokens"] <= stats["num_forced_draft_tokens"]
    alone = chat(client, CITY_PROMPT, method="target", response_format=response_format)
    assert alone.choices[0].message.content == answer  # greedy: the target's own constrained decoding


def test_json_object_and_the_other_languages(client) -> None:
    answer = chat(client, CITY_PROMPT, response_format={"type": "json_object"}).choices[0].message.content
    assert isinstance(json.loads(answer), dict)
    regex = r"[A-Z][a-z]+, [A-Z][a-z]+"
    answer = chat(client, "Name a city and its country.", extra_body={"structured_outputs": {"regex": regex}})
    assert re.fullmatch(regex, answer.choices[0].message.content)
    answer = chat(
        client, "Is water wet? Yes or no.", extra_body={"structured_outputs": {"choice": ["yes", "no"]}}
    )
    assert answer.choices[0].message.content in ("yes", "no")
    completion = client.completions.create(
        model="",
        prompt="The capital of France is",
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": 'start: " Paris" | " Lyon"'}},
    )
    assert completion.choices[0].text in (" Paris", " Lyon")


def test_tool_choice_required_answers_with_valid_calls_streamed_or_not(client) -> None:
    response = chat(
        client, WEATHER_PROMPT, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "get_time")
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        jsonschema.validate(arguments, WEATHER["function"]["parameters"])

    stream = chat(
        client,
        WEATHER_PROMPT,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        stream=True,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert not delta.content
        for piece in delta.tool_calls or ():
            entry = calls.setdefault(
                piece.index, {"id": piece.id, "name": piece.function.name, "arguments": ""}
            )
            entry["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (call.function.name, call.function.arguments)
    ]


def test_a_named_function_is_called_and_the_conversation_goes_on(client) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    response = chat(client, WEATHER_PROMPT, tools=[WEATHER, TIME], tool_choice=named)
    [call] = response.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # the call and its result back in the history: accepted, and answered in text
    followup = client.chat.completions.create(
        model="",
        messages=[
            {"role": "user", "content": WEATHER_PROMPT},
            response.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"},
        ],
        tools=[WEATHER, TIME],
        tool_choice="none",
        max_tokens=24,
        temperature=0,
    )
    assert followup.choices[0].message.content and not followup.choices[0].message.tool_calls


def test_a_schema_that_does_not_compile_is_a_400_naming_response_format(client) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, CITY_PROMPT, response_format=bad)
    assert caught.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, CITY_PROMPT, extra_body={"structured_outputs": {"regex": "(unclosed"}})
    assert caught.value.body["param"] == "structured_outputs.regex"


def test_the_grpc_sdk_takes_a_constraint(http_router) -> None:
    with Client(http_router.grpc_address, token=http_router.token) as sdk:
        done = sdk.generate(
            CITY_PROMPT,
            method=METHOD,
            max_new_tokens=MAX_TOKENS,
            constraint=json_schema_constraint(CITY),
            timeout=TIMEOUT_SECONDS,
        )
        jsonschema.validate(json.loads(done.text), CITY)
        assert done.stats["num_forced_accepted_tokens"] > 0
        digits = sdk.generate(
            "Count to three.",
            max_new_tokens=16,
            constraint=Constraint(ConstraintKind.REGEX, r"[0-9]( [0-9]){2}"),
            timeout=TIMEOUT_SECONDS,
        )
        assert re.fullmatch(r"[0-9]( [0-9]){2}", digits.text)


def test_the_cli_through_a_router_takes_a_schema_file(http_router, tmp_path, capsys) -> None:
    from specserve.cli import main

    schema = tmp_path / "city.json"
    schema.write_text(json.dumps(CITY))
    argv = ["generate", CITY_PROMPT, "--remote", http_router.grpc_address, "--token", http_router.token]
    assert main([*argv, "--json-schema", str(schema), "--max-new-tokens", str(MAX_TOKENS), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    jsonschema.validate(json.loads(printed["text"]), CITY)
    assert printed["finish_reason"] == "eos"
