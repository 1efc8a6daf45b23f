"""The OpenAPI document served at /openapi.json.

The POST routes read their bodies themselves (body.py: content type, size and strict JSON before any
field is looked at), so FastAPI cannot see what they take; their request bodies are added here from the
same pydantic models that validate them, and every route lists the errors it answers with. With bearer
tokens on (serving/auth.py), every route but the open ones declares the scheme and its 401, so clients
and generated tests know which requests need a token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from services.router.http.body import JSON_MEDIA_TYPE
from specserve.serving.auth import OPEN_PATHS

SCHEMA_REF = "#/components/schemas/{model}"


class ErrorObject(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, with every 4xx and 5xx."""

    error: ErrorObject


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


# What a generation route answers with (docs/api.md, Responses, Streaming and Errors).
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "the completion; with `stream: true`, server-sent events of chunks",
        "content": {"text/event-stream": {}},
    },
    400: _error(
        "a bad field, an unknown field or method, a prompt too long, a body that is not valid JSON, a "
        "schema, regex or grammar that does not compile (`param`: the field it came from)"
    ),
    404: _error("an unknown model"),
    413: _error("a body over the size limit"),
    415: _error("a body not sent as `Content-Type: application/json`"),
    429: _error("the router's limit of concurrent generations is reached"),
    503: _error("no target or Redis reachable"),
    504: _error("`timeout_seconds` passed"),
}
# GET /v1/streams/{stream_id}: a cut stream continued (docs/api.md, Streaming).
RESUME_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "server-sent events of the stream's chunks from `received_tokens` on",
        "content": {"text/event-stream": {}},
    },
    400: _error("a malformed stream id, or `received_tokens` beyond the tokens the session has"),
    404: _error("no session of the caller's with that id (finished long ago, cancelled, or never started)"),
    429: _error("the router's limit of concurrent generations is reached"),
    503: _error("no target or Redis reachable, or another router still drives the session"),
}
# GET /v1/models/{model_id}: the served model's card, or this.
MODEL_RESPONSES: dict[int | str, dict[str, Any]] = {404: _error("no model by that id is served")}
UNAUTHENTICATED = "no valid `Authorization: Bearer` token (the API key)"
SECURITY_SCHEME = "bearer"


# A body model's name -> its properties' schemas as this router accepts them (replacing the static ones),
# and "allOf" -> conditions every body must meet: what depends on the served model and the router.
RuntimeBounds = dict[str, dict[str, Any]]


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}], "default": None}


def install_openapi(
    app: FastAPI,
    bodies: dict[str, type[BaseModel]],
    secured: bool,
    runtime_bounds: Callable[[], RuntimeBounds],
) -> None:
    """`app.openapi()` (what /openapi.json serves) with `bodies` (POST path -> model) as the request
    bodies of those routes, their properties narrowed by `runtime_bounds()` (asked once, when the
    document is first served; it may ask a target); `secured`: bearer tokens are required outside
    OPEN_PATHS."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(
                title=app.title, version=app.version, summary=app.summary, routes=app.routes
            )
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            _drop_validation_errors(document, schemas)
            bounds = runtime_bounds()
            for path, model in bodies.items():
                schema = model.model_json_schema(ref_template=SCHEMA_REF)
                schemas.update(schema.pop("$defs", {}))
                schema["properties"].update(bounds.get(model.__name__, {}))
                schema.setdefault("allOf", []).extend(bounds.get("allOf", {}).values())
                schemas[model.__name__] = schema
                document["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {
                        JSON_MEDIA_TYPE: {"schema": {"$ref": SCHEMA_REF.format(model=model.__name__)}}
                    },
                }
            if secured:
                _declare_bearer_auth(document)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend it


def _drop_validation_errors(document: dict[str, Any], schemas: dict[str, Any]) -> None:
    """FastAPI lists a 422 for every route with a parameter; this API never answers 422 (a bad body is
    400, and the one path parameter, a model id, is any string)."""
    for operations in document["paths"].values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)


def _declare_bearer_auth(document: dict[str, Any]) -> None:
    """The token scheme, required by every operation outside OPEN_PATHS, each of which may answer 401."""
    components = document.setdefault("components", {})
    components.setdefault("securitySchemes", {})[SECURITY_SCHEME] = {"type": "http", "scheme": "bearer"}
    refusal = {
        "description": UNAUTHENTICATED,
        "content": {JSON_MEDIA_TYPE: {"schema": {"$ref": SCHEMA_REF.format(model=ErrorResponse.__name__)}}},
    }
    for path, operations in document["paths"].items():
        if path in OPEN_PATHS:
            continue
        for operation in operations.values():
            operation["security"] = [{SECURITY_SCHEME: []}]
            operation.setdefault("responses", {})["401"] = refusal
