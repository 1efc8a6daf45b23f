"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the HTTP status that
matches specserve's status code (one table, like gRPC's in specserve/serving/status.py)."""

from __future__ import annotations

from specserve.errors import SpecserveError, StatusCode, bounded, clip, quoted

# specserve status code -> (HTTP status, OpenAI error type). Codes not listed are 500 server_error.
HTTP_STATUS: dict[str, tuple[int, str]] = {
    StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "invalid_request_error"),  # as OpenAI, with code invalid_api_key
    "PERMISSION_DENIED": (403, "permission_error"),
    StatusCode.NOT_FOUND: (404, "not_found_error"),
    StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}


class HttpError(Exception):
    """An error raised by the HTTP layer itself, with its status, OpenAI type, param and code."""

    def __init__(
        self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None
    ) -> None:
        # Messages and params may quote the request (a field's name, a model's): never all of it.
        message, param = bounded(message), None if param is None else clip(param)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def invalid(message: str, param: str | None = None, code: str | None = None) -> HttpError:
    return HttpError(400, message, "invalid_request_error", param, code)


def too_large(max_bytes: int) -> HttpError:
    return HttpError(
        413, f"the request body exceeds {max_bytes} bytes", "invalid_request_error", None, "request_too_large"
    )


def unsupported_media_type(content_type: str | None) -> HttpError:
    given = "none" if content_type is None else quoted(content_type)
    return HttpError(
        415,
        f"the body must be JSON, sent with Content-Type: application/json (got {given})",
        "invalid_request_error",
        None,
        "unsupported_media_type",
    )


def from_specserve(error: SpecserveError) -> HttpError:
    status, type_ = HTTP_STATUS.get(str(error.code), (500, "server_error"))
    return HttpError(status, str(error), type_, code=str(error.code).lower())


def error_body(error: HttpError) -> dict:
    return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}
