"""What a body's structured-output fields constrain the text to: one `Constraint`, and the field it came
from (the `param` of a 400 when the engine cannot compile it).

- `response_format` (OpenAI's): `text` is no constraint, `json_object` any JSON object, `json_schema`
  JSON valid against `json_schema.schema` (enforced whatever `strict` says: decoding is constrained).
- `structured_outputs` (specserve's extension, spelled as vLLM spells it, so clients written for vLLM
  work): exactly one of `json` (a schema), `regex`, `grammar` (Lark, llguidance's dialect) or `choice`
  (one of these strings exactly, a regex of the escaped alternatives).
- chat's `tools` with `tool_choice` `auto`, `required` or a named function: a grammar (tools.py), whose
  text alternative under `auto` is `response_format`'s language when one is set.

Two sources of one constraint cannot both hold, so naming two is a 400 rather than a silent choice.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from services.router.http.errors import invalid
from services.router.http.schemas import ChatCompletionRequest, CompletionRequest, StructuredOutputs
from services.router.http.tools import tool_grammar
from specserve.core.constraint import Constraint, ConstraintKind, InvalidConstraint

JSON_OBJECT_SCHEMA = {"type": "object"}


@dataclass(frozen=True)
class BodyConstraint:
    constraint: Constraint
    param: str  # the body field that asked for it


def body_constraint(body: ChatCompletionRequest | CompletionRequest) -> BodyConstraint | None:
    """The constraint a body asks for (None: unconstrained); 400 naming the field for a bad one."""
    response = _response_format(body)
    extension = None if body.structured_outputs is None else _structured_outputs(body.structured_outputs)
    if response is not None and extension is not None:
        raise invalid("response_format and structured_outputs cannot be combined", "structured_outputs")
    tools_mode = body.tool_mode if isinstance(body, ChatCompletionRequest) else "none"
    if tools_mode == "none":
        return response or extension
    if extension is not None:
        raise invalid(
            "structured_outputs cannot be combined with tools (use tool_choice none)", "structured_outputs"
        )
    assert isinstance(body, ChatCompletionRequest) and body.tools
    # Under auto the answer is text or calls: the text in response_format's language, if it has one.
    text_schema = None
    if response is not None and tools_mode == "auto":
        text_schema = json.loads(response.constraint.source or json.dumps(JSON_OBJECT_SCHEMA))
    named = body.tool_choice.function.name if tools_mode == "named" else None  # type: ignore[union-attr]
    source = tool_grammar(
        [t.function for t in body.tools],
        mode=tools_mode,
        named=named,
        parallel=body.parallel_tool_calls is not False,
        text_schema=text_schema,
    )
    return _checked(ConstraintKind.GRAMMAR, source, "tools")


def _response_format(body: ChatCompletionRequest | CompletionRequest) -> BodyConstraint | None:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return BodyConstraint(Constraint(ConstraintKind.JSON_OBJECT), "response_format")
    assert fmt.json_schema is not None
    schema = fmt.json_schema.json_schema
    if schema is None:  # OpenAI's schema is optional; without one any JSON object is the answer
        return BodyConstraint(Constraint(ConstraintKind.JSON_OBJECT), "response_format")
    return _checked(ConstraintKind.JSON_SCHEMA, _dump(schema), "response_format")


def _structured_outputs(options: StructuredOutputs) -> BodyConstraint:
    param = "structured_outputs"
    if options.json_schema is not None:
        return _checked(ConstraintKind.JSON_SCHEMA, _dump(options.json_schema), f"{param}.json")
    if options.regex is not None:
        return _checked(ConstraintKind.REGEX, options.regex, f"{param}.regex")
    if options.grammar is not None:
        return _checked(ConstraintKind.GRAMMAR, options.grammar, f"{param}.grammar")
    assert options.choice is not None
    return _checked(ConstraintKind.REGEX, choice_regex(options.choice), f"{param}.choice")


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of `choices` (each taken literally)."""
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def _dump(schema: object) -> str:
    # Keys keep their order: a JSON object is generated with its properties in the schema's order.
    return json.dumps(schema, separators=(",", ":"))


def _checked(kind: ConstraintKind, source: str, param: str) -> BodyConstraint:
    """The constraint, or a 400 naming `param` with the shape check's message (size, empty, not JSON)."""
    try:
        return BodyConstraint(Constraint(kind, source), param)
    except InvalidConstraint as e:
        raise invalid(f"{param}: {e}", param) from None
