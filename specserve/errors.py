"""One error hierarchy for the whole project.

Every error a user can cause carries a status code. Services map `StatusCode` to gRPC codes in one
place (the codes below are named exactly as gRPC's); the CLI prints the message on one line.
"""

from __future__ import annotations

from enum import StrEnum


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
    """The caller went away (cancelled or past its deadline) before the work finished."""

    code = StatusCode.CANCELLED
