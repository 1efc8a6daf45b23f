"""The OpenAPI document served at /openapi.json.

The POST routes read their bodies themselves (body.py: content type, size and strict JSON before any
field is looked at), so FastAPI cannot see what they take; their request bodies are added here from the
same pydantic models that validate them, and every route lists the errors it answers with.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from services.router.http.body import JSON_MEDIA_TYPE

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
    400: _error("a bad field, an unknown field or method, a prompt too long, a body that is not valid JSON"),
    401: _error("auth is on and the request has no valid `Authorization: Bearer` token"),
    404: _error("an unknown model"),
    413: _error("a body over the size limit"),
    415: _error("a body not sent as `Content-Type: application/json`"),
    429: _error("the router's limit of concurrent generations is reached"),
    503: _error("no target or Redis reachable"),
    504: _error("`timeout_seconds` passed"),
}


def install_openapi(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """`app.openapi()` (what /openapi.json serves) with `bodies` (POST path -> model) as the request
    bodies of those routes."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(
                title=app.title, version=app.version, summary=app.summary, routes=app.routes
            )
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            _drop_validation_errors(document, schemas)
            for path, model in bodies.items():
                schema = model.model_json_schema(ref_template=SCHEMA_REF)
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
                document["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {
                        JSON_MEDIA_TYPE: {"schema": {"$ref": SCHEMA_REF.format(model=model.__name__)}}
                    },
                }
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
