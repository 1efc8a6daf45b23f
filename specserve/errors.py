"""One error hierarchy for the whole project.

Every error a user can cause carries a status code. Services map `StatusCode` to gRPC codes in one
place (the codes below are named exactly as gRPC's); the CLI prints the message on one line.
"""

from __future__ import annotations

from enum import StrEnum

# Error messages quote what the caller sent, but never all of it: a message travels in gRPC's trailers
# (16 KiB at most, or the client sees RESOURCE_EXHAUSTED about metadata instead of the error) and in HTTP
# error bodies, and a megabyte of echoed input helps nobody.
MAX_QUOTED_CHARS = 100  # one value a message quotes
MAX_MESSAGE_CHARS = 1000  # a whole message, whoever wrote it


class StatusCode(StrEnum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    UNAVAILABLE = "UNAVAILABLE"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    CANCELLED = "CANCELLED"
    INTERNAL = "INTERNAL"


class SpecserveError(Exception):
    """Base class of every error specserve raises on purpose."""

    code: StatusCode = StatusCode.INTERNAL


class InvalidArgument(SpecserveError):
    code = StatusCode.INVALID_ARGUMENT


class NotFound(SpecserveError):
    code = StatusCode.NOT_FOUND


class ResourceExhausted(SpecserveError):
    code = StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(SpecserveError):
    code = StatusCode.DEADLINE_EXCEEDED


class Unavailable(SpecserveError):
    code = StatusCode.UNAVAILABLE


class FailedPrecondition(SpecserveError):
    code = StatusCode.FAILED_PRECONDITION


class Unauthenticated(SpecserveError):
    """No credentials, or credentials this service does not accept."""

    code = StatusCode.UNAUTHENTICATED


class PermissionDenied(SpecserveError):
    """Valid credentials, but not for this session or this call."""

    code = StatusCode.PERMISSION_DENIED


class Cancelled(SpecserveError):
    """The work stopped before it finished: its caller went away (cancelled, or past its deadline), or a
    server this process called cancelled the call (serving/status.py's `error_from_rpc`)."""

    code = StatusCode.CANCELLED

    def __init__(self, message: str = "", code: StatusCode = StatusCode.CANCELLED) -> None:
        super().__init__(message)
        self.code = code  # what a caller sees if this error is passed on (see `error_from_rpc`)


def clip(text: str, limit: int = MAX_QUOTED_CHARS) -> str:
    """`text` cut to `limit` characters, saying how long it was."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def quoted(value: object, limit: int = MAX_QUOTED_CHARS) -> str:
    """A caller's value as an error message quotes it: its repr, cut to about `limit` characters."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    return clip(repr(value), limit)


def bounded(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """A whole message cut in the middle to at most `limit` characters: what every message goes through
    on its way to a caller (serving/status.py, the HTTP API's errors), so a value quoted without `quoted`
    cannot make it long either. The start says what went wrong and the end often lists what is valid."""
    if len(message) <= limit:
        return message
    marker = " ...({} characters cut)... "
    kept = max(0, limit - len(marker.format(len(message))))
    head = kept // 2
    return message[:head] + marker.format(len(message) - kept) + message[len(message) - (kept - head) :]
