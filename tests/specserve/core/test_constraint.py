from __future__ import annotations

import json

import pytest

from specserve.core.constraint import MAX_CONSTRAINT_CHARS, Constraint, ConstraintKind, InvalidConstraint
from specserve.core.request import GenerationRequest, InvalidField
from specserve.grammar.schema import json_schema_constraint


@pytest.mark.parametrize(
    ("kind", "source", "message"),
    [
        (ConstraintKind.REGEX, "  ", "is empty"),
        (ConstraintKind.JSON_OBJECT, "{}", "takes no source"),
        (ConstraintKind.GRAMMAR, "x" * (MAX_CONSTRAINT_CHARS + 1), "at most"),
    ],
)
def test_malformed_constraints_are_refused(kind: ConstraintKind, source: str, message: str):
    with pytest.raises(InvalidConstraint, match=message):
        Constraint(kind, source)


def test_schema_keeps_its_property_order():
    # A schema's property order is the order its JSON is written in: it must survive.
    constraint = json_schema_constraint({"type": "object", "properties": {"b": {}, "a": {}}})
    assert list(json.loads(constraint.source)["properties"]) == ["b", "a"]


def test_a_constrained_request_round_trips_through_its_record():
    constraint = Constraint(ConstraintKind.REGEX, "[a-z]+")
    request = GenerationRequest.build(method="glide-cape", constraint=constraint)
    assert GenerationRequest.from_dict(json.loads(json.dumps(request.to_dict()))) == request
    plain = GenerationRequest.build()
    assert GenerationRequest.from_dict(json.loads(json.dumps(plain.to_dict()))).constraint is None


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"ignore_eos": True}, "ignore_eos"),
        ({"method": "mcsd-target-init"}, "method"),
        ({"method": "hf"}, "method"),
    ],
)
def test_what_cannot_run_under_a_constraint_is_refused(changes: dict, field: str):
    with pytest.raises(InvalidField) as error:
        GenerationRequest.build(constraint=Constraint(ConstraintKind.JSON_OBJECT), **changes)
    assert error.value.field == field
