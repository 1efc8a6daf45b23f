"""Function calling: how chat's `tools` reach the model, and the grammar its answer is held to.

One format for every model, Hermes' (which Qwen2.5's template speaks natively):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, blocks separated by a newline. A chat template that takes `tools` and speaks this
format gets the tools itself (`RouterTokenizer.native_tools`); any other (SmolLM2's has no tools) gets
them in the system message with the format spelled out, and earlier calls and their results rendered as
that text. The answer is held to the format by a Lark grammar (llguidance's dialect) whose calls embed
each function's parameters schema (`%json`), so the arguments always parse and validate:

- `required`: one call or more (exactly one when `parallel_tool_calls` is false);
- a named function: one call of it;
- `auto`: either calls as above, or text that does not open with `<tool_call>` (or, with
  `response_format`, JSON in that format). Constraining `auto` rather than parsing free text afterwards
  keeps a started call valid (a free-running model can open a call and break its JSON), still lets the
  model answer in prose, and tells the stream at the first characters which of the two it is reading.
  Text that only mentions a call later on stays text.

The grammar's fixed parts (`<tool_call>\\n{"name": "`, a lone function's name, `"arguments": `, the
arguments' required keys) are forced tokens: free drafts under speculation. The JSON is written in one
layout (`", "` and `": "`, no other whitespace), as the engine writes JSON, so they can be.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from typing import Any

from services.router.http.schemas import ChatCompletionRequest, ChatMessage, FunctionDefinition
from specserve.core.constraint import Constraint, ConstraintKind
from specserve.grammar.compiler import JSON_LAYOUT  # the engine's one layout, which the format shows

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
MARKER = "// specserve tool calls: "  # the first line of a tool grammar, then its mode (a Lark comment)
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}

# Where JSON Schema keeps a document's local definitions ("#/$defs/x" and the older "#/definitions/x").
_DEFINITIONS = ("$defs", "definitions")


def call_schema(function: FunctionDefinition) -> dict[str, Any]:
    """JSON Schema of one call's body: its name, then its arguments (llguidance keeps the order)."""
    arguments = copy.deepcopy(function.parameters) if function.parameters is not None else NO_ARGUMENTS
    schema: dict[str, Any] = {
        "x-guidance": JSON_LAYOUT,
        "type": "object",
        "properties": {"name": {"const": function.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    # The parameters' own references ("#/$defs/x") resolve against the document's root: move their
    # definitions there.
    for key in _DEFINITIONS:
        if isinstance(arguments, dict) and key in arguments:
            schema[key] = arguments.pop(key)
    return schema


def tool_grammar(
    functions: Sequence[FunctionDefinition],
    *,
    mode: str,
    named: str | None = None,
    parallel: bool = True,
    text_schema: dict[str, Any] | None = None,
) -> str:
    """The Lark grammar of an answer under `tool_choice` `mode` ("auto", "required", "named")."""
    if mode == "named":
        functions = [f for f in functions if f.name == named]
    rules = [f"fn_{i}: %json {json.dumps(call_schema(f))}" for i, f in enumerate(functions)]
    calls = 'call ("\\n" call)*' if parallel and mode != "named" else "call"
    lines = [
        f"calls: {calls}",
        f'call: "{OPEN}\\n" ({" | ".join(f"fn_{i}" for i in range(len(functions)))}) "\\n{CLOSE}"',
        *rules,
    ]
    header = f"{MARKER}{'auto' if mode == 'auto' else 'required'}"
    if mode != "auto":
        return "\n".join([header, "start: calls", *lines]) + "\n"
    if text_schema is not None:
        text = [f"text: %json {json.dumps({'x-guidance': JSON_LAYOUT} | text_schema)}"]
    else:  # any text whose first characters, past whitespace, are not a call's opening
        text = ["text: TEXT", f"TEXT: /(?s:.*)/ & ~/[ \\t\\r\\n]*{OPEN}(?s:.*)/"]
    return "\n".join([header, "start: text | calls", *text, *lines]) + "\n"


def grammar_tool_mode(constraint: Constraint | None) -> str:
    """The tool_choice a session's constraint was built for ("auto", "required", else "none"): how a
    resumed stream, which has the session but not the request's tools, splits its text."""
    if constraint is None or constraint.kind is not ConstraintKind.GRAMMAR:
        return "none"
    first = constraint.source.partition("\n")[0]
    mode = first.removeprefix(MARKER)
    return mode if first.startswith(MARKER) and mode in ("auto", "required") else "none"


def tools_instructions(functions: Sequence[FunctionDefinition], mode: str, named: str | None) -> str:
    """The system message's part for a template that does not take tools: the functions and the format."""
    signatures = "\n".join(json.dumps(f.model_dump(exclude_none=True)) for f in functions)
    must = {
        "required": "\nAnswer with one or more function calls.",
        "named": f"\nAnswer by calling {named}.",
    }.get(mode, "")
    return (
        "# Tools\n\nYou may call one or more functions to answer. Their signatures, as JSON:\n"
        f"{signatures}\n\nTo call a function, answer with only this, one block per call:\n"
        f'{OPEN}\n{{"name": <function name>, "arguments": <the arguments as a JSON object>}}\n{CLOSE}'
        f"{must}"
    )


def template_tools(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The tools as chat templates take them (transformers' convention)."""
    return [
        {"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in body.tools or ()
    ]


def chat_messages(body: ChatCompletionRequest, native: bool) -> list[dict[str, Any]]:
    """The conversation as the chat template renders it. `native`: the template takes `tools`, calls and
    tool messages itself; otherwise they become text in the format above, a tool's answer a user turn."""
    if native:
        return [_native(m) for m in body.messages]
    messages: list[dict[str, Any]] = []
    for message in body.messages:
        if message.role == "tool":
            response = f"<tool_response>\n{message.text}\n</tool_response>"
            if messages and messages[-1].get("tool_responses"):  # answers in a row share one turn
                messages[-1]["content"] += "\n" + response
            else:
                messages.append({"role": "user", "content": response, "tool_responses": True})
            continue
        content = message.text
        if message.tool_calls:
            blocks = [_call_text(c.function.name, c.function.arguments) for c in message.tool_calls]
            content = "\n".join([content, *blocks] if content else blocks)
        messages.append({"role": message.role, "content": content})
    for m in messages:
        m.pop("tool_responses", None)
    if body.tool_mode != "none" and body.tools:
        named = body.tool_choice.function.name if body.tool_mode == "named" else None  # type: ignore[union-attr]
        instructions = tools_instructions([t.function for t in body.tools], body.tool_mode, named)
        if messages[0]["role"] in ("system", "developer"):
            messages[0]["content"] = f"{messages[0]['content']}\n\n{instructions}"
        else:
            messages.insert(0, {"role": "system", "content": instructions})
    return messages


def _call_text(name: str, arguments: str) -> str:
    return f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n{CLOSE}'


def _native(message: ChatMessage) -> dict[str, Any]:
    rendered: dict[str, Any] = {"role": message.role, "content": message.text}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                # templates write the arguments with `tojson`: an object, as transformers passes them
                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
            }
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        rendered["name"] = message.name
    return rendered


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:  # a client's own text: rendered as it was sent
        return text
