"""JSON schemas as constraints: the one place a schema is written to, and read from, JSON text."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from specserve.core.constraint import Constraint, ConstraintKind, InvalidConstraint


def json_schema_constraint(schema: Mapping[str, Any] | bool) -> Constraint:
    """The constraint of a JSON schema document. Key order is kept: a schema's property order is the order
    its JSON is written in."""
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema, separators=(",", ":")))


def parse_json_schema(source: str) -> dict[str, Any] | bool:
    """A JSON_SCHEMA constraint's document; InvalidConstraint when it is not JSON, or not a schema's type."""
    try:
        schema = json.loads(source)
    except json.JSONDecodeError as e:
        raise InvalidConstraint(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict | bool):
        raise InvalidConstraint("a JSON schema must be an object or a boolean")
    return schema
