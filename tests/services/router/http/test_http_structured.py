"""A body's structured-output fields -> the one Constraint they ask for, and the 400s (OpenAI's error, the
field as `param`) for shapes that cannot be one. In process: no model, no stack."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.router.http.body import parse
from services.router.http.errors import HttpError
from services.router.http.generation import constraint_error
from services.router.http.schemas import ChatCompletionRequest, CompletionRequest
from services.router.http.structured import BodyConstraint, body_constraint, choice_regex
from specserve.core.constraint import MAX_CONSTRAINT_CHARS, Constraint, ConstraintKind
from specserve.errors import InvalidArgument

CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {
    "type": "object",
    "properties": {"b": {"type": "string"}, "a": {"type": "integer"}},
    "required": ["b"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def chat(**fields: Any) -> ChatCompletionRequest:
    return parse(json.dumps(CHAT | fields).encode(), ChatCompletionRequest)


def refusal(model: type = ChatCompletionRequest, **fields: Any) -> HttpError:
    base = CHAT if model is ChatCompletionRequest else {"prompt": "hi"}
    with pytest.raises(HttpError) as caught:
        body = parse(json.dumps(base | fields).encode(), model)
        body_constraint(body)
    assert caught.value.status == 400 and caught.value.type == "invalid_request_error"
    return caught.value


def test_no_structured_fields_and_text_are_unconstrained() -> None:
    assert body_constraint(chat()) is None
    assert body_constraint(chat(response_format={"type": "text"})) is None
    assert body_constraint(chat(tools=[WEATHER], tool_choice="none")) is None


def test_json_object_and_json_schema_as_openai_sends_them() -> None:
    found = body_constraint(chat(response_format={"type": "json_object"}))
    assert found == BodyConstraint(Constraint(ConstraintKind.JSON_OBJECT), "response_format")
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    found = body_constraint(chat(response_format=fmt))
    assert found is not None and found.param == "response_format"
    assert found.constraint.kind is ConstraintKind.JSON_SCHEMA
    assert json.loads(found.constraint.source) == SCHEMA
    # the properties keep their order: the object is generated in the schema's order
    assert list(json.loads(found.constraint.source)["properties"]) == ["b", "a"]


def test_a_json_schema_without_a_schema_is_any_object() -> None:
    found = body_constraint(chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}))
    assert found is not None and found.constraint.kind is ConstraintKind.JSON_OBJECT


@pytest.mark.parametrize(
    ("options", "kind", "source", "param"),
    [
        ({"json": SCHEMA}, ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA, separators=(",", ":")), "json"),
        ({"regex": r"\d{3}"}, ConstraintKind.REGEX, r"\d{3}", "regex"),
        ({"grammar": 'start: "yes" | "no"'}, ConstraintKind.GRAMMAR, 'start: "yes" | "no"', "grammar"),
        ({"choice": ["a.b", "c"]}, ConstraintKind.REGEX, r"(a\.b|c)", "choice"),
    ],
)
def test_the_extension_names_the_other_kinds(
    options: dict, kind: ConstraintKind, source: str, param: str
) -> None:
    for model, base in ((ChatCompletionRequest, CHAT), (CompletionRequest, {"prompt": "hi"})):
        body = parse(json.dumps(base | {"structured_outputs": options}).encode(), model)
        assert body_constraint(body) == BodyConstraint(
            Constraint(kind, source), f"structured_outputs.{param}"
        )


def test_choice_is_literal() -> None:
    import re

    pattern = re.compile(choice_regex(["1+1", "(x)", "a|b"]))
    assert all(pattern.fullmatch(c) for c in ["1+1", "(x)", "a|b"])
    assert not pattern.fullmatch("11") and not pattern.fullmatch("a")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_object", "json_schema": {"name": "x"}}},
            "response_format.json_schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name"}}}, None),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}, None),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "grammar": "b"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": None}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": " "}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "x" * (MAX_CONSTRAINT_CHARS + 1)}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"xml": "a"}}, "structured_outputs.xml"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
        ),
        ({"tools": [WEATHER], "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ],
)
def test_wrong_shapes_are_400_naming_the_field(fields: dict, param: str | None) -> None:
    error = refusal(**fields)
    if param is not None:
        assert error.param == param, error.message
    else:
        assert (error.param or "").startswith("response_format.json_schema"), error.message


def test_a_constraint_the_engine_cannot_compile_is_the_fields_400() -> None:
    """The engine's InvalidConstraint crosses gRPC as INVALID_ARGUMENT with no field: before the first
    token of a constrained request, it is the constraint's."""
    from services.router.http.errors import from_specserve

    source = body_constraint(
        chat(
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}
        )
    )
    error = constraint_error(from_specserve(InvalidArgument("the JSON schema does not compile")), source)
    assert (error.status, error.param, error.type) == (400, "response_format", "invalid_request_error")
    unconstrained = constraint_error(from_specserve(InvalidArgument("x")), None)
    assert unconstrained.param is None
