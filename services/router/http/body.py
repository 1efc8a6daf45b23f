"""From the bytes of a POST to a validated request body, refusing bad input before it costs anything.

In order: the content type (415 unless JSON: a page on another site can send a form or text/plain to the
API without asking the browser first, but not JSON), the body's size (413), its JSON and fields (400,
parsed in Rust by pydantic: nesting depth bounded, text valid Unicode, types strict), then the prompt's
size in characters (400, the bound gRPC Generate applies, serving/validate.py), all before the tokenizer
sees the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import ValidationError
from starlette.requests import Request

from services.router.http.errors import HttpError, invalid, too_large, unsupported_media_type
from services.router.http.schemas import ChatCompletionRequest, CompletionRequest
from specserve.errors import InvalidArgument, clip
from specserve.serving.validate import check_prompt_length, prompt_char_limit

Body = TypeVar("Body", ChatCompletionRequest, CompletionRequest)

JSON_MEDIA_TYPE = "application/json"
# Bytes a prompt's character can take in JSON: a character outside the BMP written as two \uXXXX escapes
# (what json.dumps does by default).
MAX_JSON_BYTES_PER_CHAR = 12
# Everything in a body but the prompt: up to 16 stop strings of 256 characters, roles, sampling settings.
OTHER_FIELDS_BYTES = 64 * 1024

# pydantic's labels for the members of a union, as they appear in an error's location -> what to call them
_UNION_MEMBERS = {
    "str": "a string",
    "list[str]": "a list of strings",
    "list[int]": "a list of token ids",
    "list[TextPart]": "a list of text parts",
}


@dataclass(frozen=True)
class BodyBounds:
    """How large a body and its prompt may be, from the served model's `max_prompt_tokens`."""

    max_prompt_tokens: int
    max_token_chars: int  # the most characters one token of the vocabulary covers
    max_body_bytes: int  # the smaller of the router's http_max_body_bytes and what the prompt bound allows

    @classmethod
    def of(cls, max_prompt_tokens: int, max_token_chars: int, http_max_body_bytes: int) -> BodyBounds:
        prompt_bytes = prompt_char_limit(max_prompt_tokens, max_token_chars) * MAX_JSON_BYTES_PER_CHAR
        return cls(
            max_prompt_tokens, max_token_chars, min(http_max_body_bytes, prompt_bytes + OTHER_FIELDS_BYTES)
        )


async def read_body(request: Request, model: type[Body], bounds: BodyBounds) -> Body:
    """The request's body as `model`, or the HttpError that refuses it."""
    content_type = request.headers.get("content-type")
    if (content_type or "").partition(";")[0].strip().lower() != JSON_MEDIA_TYPE:
        raise unsupported_media_type(content_type)
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > bounds.max_body_bytes:  # refused before it is read
        raise too_large(bounds.max_body_bytes)
    raw = await request.body()
    if len(raw) > bounds.max_body_bytes:
        raise too_large(bounds.max_body_bytes)
    body = parse(raw, model)
    try:
        check_prompt_length(body.prompt_chars, bounds.max_prompt_tokens, bounds.max_token_chars)
    except InvalidArgument as e:
        raise invalid(str(e), body.prompt_param) from None
    return body


def parse(raw: bytes, model: type[Body]) -> Body:
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise refusal(e.errors(include_url=False)) from None


def refusal(errors: Sequence[Any]) -> HttpError:
    """The 400 for pydantic's errors about a body: the first error, named by its field (`param`)."""
    first = errors[0]
    if first["type"] == "json_invalid":
        reason = first["ctx"]["error"]
        return invalid(f"the body is not valid JSON: {reason}{_json_hint(reason)}")
    if first["type"] == "model_type" and not first["loc"]:
        return invalid("the body must be a JSON object")
    path = _field_path(first["loc"])
    param = ".".join(str(part) for part in path) or None
    if first["type"] == "extra_forbidden":
        return invalid(f"unrecognized request argument supplied: {clip(str(param))}", param)
    members = _union_members(errors, path)
    if len(members) > 1:  # no member of a union matched: say what would have
        return invalid(f"{param}: must be {', '.join(members[:-1])} or {members[-1]}", param)
    return invalid(f"{param}: {first['msg']}" if param else first["msg"], param)


def _json_hint(reason: str) -> str:
    if "recursion limit" in reason:
        return " (nested too deeply)"
    if "surrogate" in reason or "hex escape" in reason:
        return " (a \\u escape is 4 hex digits, and a surrogate \\ud800-\\udfff must be half of a pair)"
    if "unicode code point" in reason:
        return " (the body must be UTF-8 encoding valid characters)"
    return ""


def _is_union_member(part: object) -> bool:
    return isinstance(part, str) and part in _UNION_MEMBERS


def _field_path(loc: Sequence[object]) -> tuple[object, ...]:
    """The location of an error up to the first union member label: the field the caller wrote."""
    for i, part in enumerate(loc):
        if _is_union_member(part):
            return tuple(loc[:i])
    return tuple(loc)


def _union_members(errors: Sequence[Any], path: tuple[object, ...]) -> list[str]:
    members: list[str] = []
    for error in errors:
        loc = tuple(error["loc"])
        if loc[: len(path)] == path and len(loc) > len(path) and _is_union_member(loc[len(path)]):
            member = _UNION_MEMBERS[str(loc[len(path)])]
            if member not in members:
                members.append(member)
    return members
