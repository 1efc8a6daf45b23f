"""What a constrained generation must produce: a formal language its text has to belong to.

A constraint masks the target's next-token distribution at every position to the tokens the language
allows after what came before (core/grammar.py walks it over a draft tree), so a speculative
generation under a constraint is exactly the target's own constrained decoding. Torch-free: the router
validates and stores constraints too; compiling one needs the model's tokenizer (specserve/grammar).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from specserve.errors import InvalidArgument

# Bounds of a constraint's source: a schema or grammar is compiled per request (then cached), so its
# size bounds the work one request can ask of the server.
MAX_CONSTRAINT_CHARS = 64 * 1024


class ConstraintKind(StrEnum):
    JSON_SCHEMA = "json_schema"  # a JSON Schema document (OpenAI's response_format json_schema)
    JSON_OBJECT = "json_object"  # any JSON object (OpenAI's response_format json_object); no source
    REGEX = "regex"  # the whole text matches this regular expression
    GRAMMAR = "grammar"  # a context-free grammar in Lark syntax (llguidance's dialect)


@dataclass(frozen=True)
class Constraint:
    kind: ConstraintKind
    source: str = ""  # the schema (JSON text), the regex or the grammar; "" for JSON_OBJECT

    def __post_init__(self) -> None:
        check_constraint(self)

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind.value, "source": self.source}

    @classmethod
    def from_dict(cls, data: Mapping[str, str]) -> Constraint:
        return cls(ConstraintKind(data["kind"]), data["source"])


class InvalidConstraint(InvalidArgument):
    """A constraint that cannot be compiled or is out of bounds (HTTP 400, gRPC INVALID_ARGUMENT)."""


def check_constraint(constraint: Constraint) -> None:
    """Shape checks that need no tokenizer and no parsing; compiling (specserve/grammar) checks the rest,
    a JSON schema's JSON included (specserve/grammar/schema.py)."""
    if not isinstance(constraint.kind, ConstraintKind):
        raise InvalidConstraint(f"unknown constraint kind {constraint.kind!r}")
    if len(constraint.source) > MAX_CONSTRAINT_CHARS:
        raise InvalidConstraint(
            f"the {constraint.kind.value} has {len(constraint.source)} characters; at most "
            f"{MAX_CONSTRAINT_CHARS} allowed"
        )
    if constraint.kind is ConstraintKind.JSON_OBJECT:
        if constraint.source:
            raise InvalidConstraint("a json_object constraint takes no source")
        return
    if not constraint.source.strip():
        raise InvalidConstraint(f"the {constraint.kind.value} is empty")
