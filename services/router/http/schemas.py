"""Request bodies of the OpenAI-compatible API, validated once at the edge.

Unknown fields are refused (400 naming the field), as OpenAI does, so a client never believes a setting
took effect when it did not. Fields OpenAI has and specserve does not support yet are accepted only at
their neutral value (n = 1, no penalties, no logit bias, echo false). specserve's own fields (`method`,
`allow_lossy`, `top_k`, `ignore_eos`, `timeout_seconds`, `structured_outputs`) go in the body next to
OpenAI's (the `openai` client's `extra_body`).

Structured output: OpenAI's `response_format` and chat's `tools` / `tool_choice` are shapes here; what
they constrain the text to is decided in structured.py and tools.py.

Types are JSON's, strictly: a boolean is not a number, a string is not a boolean, a number with a
fractional part is not an integer (one without, such as `1.0` or `1e2`, is: JSON Schema's "integer"),
and numbers are finite (pydantic's strict mode; NaN, Infinity and numbers beyond a double's
range are refused), so a value never means something its sender did not write.

The OpenAPI document states the bounds that do not depend on the served model here (`documented`): the
sampling and stopping bounds GenerationRequest.build checks, from the same constants, the neutral values
of the unsupported fields, and which field needs which. They are only documented here: the checks stay
where they are (gRPC and HTTP refuse the same input with the same message). What depends on the model
or the router (the model's name, method names and the lossy ones, `max_tokens` up to the server's
limit, token ids, log-probabilities) is added to the document when it is served (openapi.py,
`runtime_bounds`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.router.http.errors import invalid
from specserve.core.request import (
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MAX_TOP_LOGPROBS,
)
from specserve.errors import quoted

MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's bound on `logprobs`


def _integral(value: Any) -> Any:
    """A JSON number with no fractional part as the integer it is (`1.0`, `1e2`): JSON Schema's
    "integer" is any such number, and the OpenAPI document says "integer" (what the integer fields'
    validators below apply). Anything else, a boolean included, is left for strict validation to refuse."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


def documented(
    schema: dict[str, Any], default: Any = None, nullable: bool = True, alias: str | None = None
) -> Any:
    """A field that the OpenAPI document describes as `schema` (or null), checked elsewhere (see above).
    `default=...`: required."""
    extra: dict[str, Any] = {"anyOf": [schema, {"type": "null"}]} if nullable else schema
    return Field(default, alias=alias, json_schema_extra=extra)


NOT_BLANK = r"\S"  # a JSON Schema pattern: one character that is not whitespace
# A message with text beyond whitespace: a chat needs one (the router's tokenizer refuses a blank chat).
# `required`: without it a message with no content at all (an assistant's tool calls alone) would
# satisfy `properties` vacuously, and the document would call a chat of calls and blanks valid.
NON_BLANK_MESSAGE: dict[str, Any] = {
    "properties": {
        "content": {
            "anyOf": [
                {"type": "string", "pattern": NOT_BLANK},
                {
                    "type": "array",
                    "contains": {
                        "properties": {"text": {"type": "string", "pattern": NOT_BLANK}},
                        "required": ["text"],
                    },
                },
            ]
        }
    },
    "required": ["content"],
}
STOP_STRING: dict[str, Any] = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_CHARS}


def needs(field: str, value: object, when: dict[str, Any]) -> dict[str, Any]:
    """JSON Schema for "`field` must be `value` whenever `when` holds (a property -> its schema)"."""
    return {
        "if": {"properties": when, "required": list(when)},
        "then": {"properties": {field: {"const": value}}, "required": [field]},
    }


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class TextPart(Strict):
    type: Literal["text"]
    text: str


# OpenAI's rule for a function's name (and a json_schema's): it appears in prompts and in grammars.
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(Strict):
    """A call an assistant message made earlier in the conversation."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(Strict):
    # What _check_message refuses, stated for the OpenAPI document.
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                {
                    "anyOf": [
                        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
                        {
                            "required": ["role", "tool_calls"],
                            "properties": {
                                "role": {"const": "assistant"},
                                "tool_calls": {"type": "array", "minItems": 1},
                            },
                        },
                    ]
                },
                {
                    "if": {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array"}}},
                    "then": {"properties": {"role": {"const": "assistant"}}},
                },
                {
                    "if": {"properties": {"role": {"const": "tool"}}},
                    "then": {
                        "required": ["tool_call_id"],
                        "properties": {"tool_call_id": {"type": "string"}},
                    },
                    "else": {"properties": {"tool_call_id": {"type": "null"}}},
                },
            ]
        }
    )

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # None only for an assistant message that made tool calls (ChatCompletionRequest checks)
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant only
    tool_call_id: str | None = None  # tool only: the call this message answers

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    @property
    def num_chars(self) -> int:
        calls = sum(len(c.function.name) + len(c.function.arguments) for c in self.tool_calls or ())
        return len(self.text) + calls


class JsonSchemaFormat(Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    # "schema" is a BaseModel attribute: the field takes another name and reads the JSON key by alias
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None  # the schema is enforced either way (constrained decoding)


class ResponseFormat(Strict):
    """OpenAI's response_format: plain text, any JSON object, or JSON valid against a schema."""

    model_config = ConfigDict(
        json_schema_extra={
            "if": {"properties": {"type": {"const": "json_schema"}}},
            "then": {"required": ["json_schema"], "properties": {"json_schema": {"type": "object"}}},
            "else": {"properties": {"json_schema": {"type": "null"}}},
        }
    )

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _shape(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise invalid(
                "response_format of type json_schema needs json_schema", "response_format.json_schema"
            )
        if self.type != "json_schema" and self.json_schema is not None:
            raise invalid(
                f"response_format of type {self.type} takes no json_schema", "response_format.json_schema"
            )
        return self


class StructuredOutputs(Strict):
    """specserve's extension (vLLM's spelling): the other languages a text can be held to; exactly one,
    not null."""

    model_config = ConfigDict(json_schema_extra={"minProperties": 1, "maxProperties": 1})

    json_schema: dict[str, Any] | bool | None = documented(
        {"type": ["object", "boolean"]}, alias="json", nullable=False
    )
    regex: str | None = documented({"type": "string"}, nullable=False)
    grammar: str | None = documented({"type": "string"}, nullable=False)  # Lark, llguidance's dialect
    choice: list[str] | None = documented(
        {"type": "array", "items": {"type": "string"}, "minItems": 1}, nullable=False
    )

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        given = sorted(self.model_fields_set)
        if len(given) != 1 or self.chosen() is None:
            spelled = ", ".join("json" if name == "json_schema" else name for name in given)
            raise invalid(
                "structured_outputs takes exactly one of json, regex, grammar, choice, not null"
                + (f" (got {spelled})" if given else ""),
                "structured_outputs",
            )
        if self.choice is not None and not self.choice:
            raise invalid("structured_outputs.choice needs at least one string", "structured_outputs.choice")
        return self

    def chosen(self) -> Any:
        (name,) = self.model_fields_set
        return getattr(self, name)


class FunctionDefinition(Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; None: no arguments
    strict: bool | None = None  # the schema is enforced either way


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(Strict):
    include_usage: bool = False


class GenerationFields(Strict):
    """What chat and completions share: sampling, stopping, streaming and specserve's extensions."""

    model: str | None = None  # None = the served model; any other name is 404
    max_tokens: int | None = Field(default=None, ge=1)
    # OpenAI's default is 1
    temperature: float | None = documented({"type": "number", "minimum": 0, "maximum": MAX_TEMPERATURE})
    top_p: float | None = documented({"type": "number", "exclusiveMinimum": 0, "maximum": 1})
    seed: int | None = documented({"type": "integer", "minimum": 0, "maximum": MAX_SEED - 1})
    stop: str | list[str] | None = documented(
        {"anyOf": [STOP_STRING, {"type": "array", "items": STOP_STRING, "maxItems": MAX_STOP_STRINGS}]}
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = documented({"const": 1})
    presence_penalty: float | None = documented({"const": 0})
    frequency_penalty: float | None = documented({"const": 0})
    logit_bias: dict[str, float] | None = documented({"type": "object", "maxProperties": 0})
    user: str | None = None
    # specserve's extensions
    method: str | None = None  # draft method; "target" turns speculation off; None = the router's default
    allow_lossy: bool = False  # opt in to a lossy method at temperature > 0
    # checked with the rest of the request (GenerationRequest.build)
    top_k: int | None = documented({"type": "integer", "minimum": 0, "maximum": MAX_TOP_K})
    ignore_eos: bool = False
    timeout_seconds: float | None = Field(default=None, gt=0)  # 504 when the generation takes longer
    # structured output (structured.py): OpenAI's field, and the other languages as vLLM spells them
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @field_validator("max_tokens", "seed", "n", "top_k", mode="before")
    @classmethod
    def _integers(cls, value: Any) -> Any:
        return _integral(value)

    @model_validator(mode="after")
    def _unsupported(self) -> GenerationFields:
        if self.n not in (None, 1):
            raise invalid("n must be 1: specserve returns one choice per request", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                raise invalid(f"{name} is not supported (only 0)", name)
        if self.logit_bias:
            raise invalid("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options needs stream: true", "stream_options")
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(GenerationFields):
    prompt_param: ClassVar[str] = "messages"  # the field an error about the prompt names

    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                needs("stream", True, {"stream_options": {"type": "object"}}),
                needs("logprobs", True, {"top_logprobs": {"type": "integer", "minimum": 1}}),
            ]
        }
    )

    messages: list[ChatMessage] = Field(min_length=1, json_schema_extra={"contains": NON_BLANK_MESSAGE})
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # default true, as OpenAI's

    @field_validator("max_completion_tokens", "top_logprobs", mode="before")
    @classmethod
    def _chat_integers(cls, value: Any) -> Any:
        return _integral(value)

    @model_validator(mode="after")
    def _chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
        for i, message in enumerate(self.messages):
            _check_message(i, message)
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise invalid("tools: function names must be unique", "tools")
        if self.tool_choice not in (None, "none") and not names:
            raise invalid("tool_choice needs tools", "tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            name = quoted(self.tool_choice.function.name)
            raise invalid(f"tool_choice names the function {name}, which is not in tools", "tool_choice")
        return self

    @property
    def tool_mode(self) -> str:
        """How the tools bind the answer: "none" (no tools, or tool_choice none), "auto" (text or
        calls, OpenAI's default with tools), "required" (one call or more) or "named" (that function)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_top_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def prompt_chars(self) -> int:
        """Characters of text the prompt's tokenization covers (bounded before it runs), the tools'
        definitions included (they are rendered into the prompt)."""
        tools = sum(len(t.function.model_dump_json()) for t in self.tools or ())
        return sum(m.num_chars for m in self.messages) + tools


def _check_message(index: int, message: ChatMessage) -> None:
    """The fields each role takes: content everywhere but in an assistant message that made calls, calls
    only from the assistant, and a tool's answer names its call."""
    at = f"messages.{index}"
    if message.content is None and not (message.role == "assistant" and message.tool_calls):
        raise invalid(f"{at}.content: a {message.role} message needs content", f"{at}.content")
    if message.tool_calls is not None and message.role != "assistant":
        raise invalid(f"{at}.tool_calls: only assistant messages make tool calls", f"{at}.tool_calls")
    if (message.role == "tool") != (message.tool_call_id is not None):
        raise invalid(
            f"{at}.tool_call_id: a tool message needs tool_call_id, and only a tool message takes it",
            f"{at}.tool_call_id",
        )


class CompletionRequest(GenerationFields):
    prompt_param: ClassVar[str] = "prompt"

    model_config = ConfigDict(
        json_schema_extra={"allOf": [needs("stream", True, {"stream_options": {"type": "object"}})]}
    )

    # one text (a list of one, as OpenAI's batch form), or token ids; never empty
    prompt: str | list[str] | list[int] = documented(
        {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
                {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
            ]
        },
        default=...,
        nullable=False,
    )
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = documented({"const": False}, default=False, nullable=False)
    suffix: str | None = documented({"type": "string", "maxLength": 0})
    best_of: int | None = documented({"const": 1})

    @field_validator("logprobs", "best_of", mode="before")
    @classmethod
    def _completion_integers(cls, value: Any) -> Any:
        return _integral(value)

    @field_validator("prompt", mode="before")
    @classmethod
    def _token_ids(cls, value: Any) -> Any:
        return [_integral(v) for v in value] if isinstance(value, list) else value

    @model_validator(mode="after")
    def _completion(self) -> CompletionRequest:
        batch = isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str)
        if batch and len(self.prompt) != 1:
            raise invalid("prompt must be one string or one list of token ids (no batches)", "prompt")
        if self.echo:
            raise invalid("echo is not supported", "echo")
        if self.suffix:
            raise invalid("suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise invalid("best_of must be 1", "best_of")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_top_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def prompt_chars(self) -> int:
        """Characters of text to tokenize (token ids need none; their number is checked with the rest)."""
        if isinstance(self.prompt, str):
            return len(self.prompt)
        return sum(len(p) for p in self.prompt if isinstance(p, str))
