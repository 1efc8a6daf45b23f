"""Constrained generation through the shared stack (router, draft and target processes): the same
tokens as the in-process target's own constrained decoding, forced tokens reported per round, and
constraints that cannot run refused with INVALID_ARGUMENT."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from specserve.core.constraint import Constraint, ConstraintKind
from specserve.core.request import GenerationRequest
from specserve.grammar.schema import json_schema_constraint
from specserve.serving.convert import constraint_to_pb
from specserve.v1 import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)

pytestmark = pytest.mark.model

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population_millions": {"type": "number"}},
    "required": ["city", "population_millions"],
    "additionalProperties": False,
}
PROMPT = "Paris has about 2.1 million inhabitants. Give the city and its population in millions as JSON."


@pytest.fixture(scope="module")
def router(channels) -> router_pb2_grpc.RouterServiceStub:
    return router_pb2_grpc.RouterServiceStub(channels["router"])


def test_the_stack_decodes_as_the_target_alone_under_a_schema(router, default_engine):
    constraint = json_schema_constraint(SCHEMA)
    expected = default_engine.generate(
        PROMPT, GenerationRequest.build(method="target", constraint=constraint, max_new_tokens=64)
    )
    request = router_pb2.GenerateRequest(
        prompt=PROMPT, max_new_tokens=64, constraint=constraint_to_pb(constraint)
    )
    responses = list(router.Generate(request, timeout=120))
    tokens = [t for r in responses for t in r.token_ids]
    assert tokens == expected.token_ids
    jsonschema.validate(json.loads("".join(r.text for r in responses)), SCHEMA)
    stats = responses[-1].stats
    assert stats.num_forced_accepted_tokens > 0
    assert sum(r.round.num_forced_accepted_tokens for r in responses if r.HasField("round")) == (
        stats.num_forced_accepted_tokens
    )


@pytest.mark.parametrize(
    "constraint",
    [
        common_pb2.Constraint(kind=common_pb2.CONSTRAINT_KIND_JSON_SCHEMA, source='{"type": "nonsense"}'),
        common_pb2.Constraint(kind=common_pb2.CONSTRAINT_KIND_REGEX, source="(unclosed"),
        common_pb2.Constraint(kind=common_pb2.CONSTRAINT_KIND_JSON_SCHEMA, source="not json"),
        common_pb2.Constraint(source="[a-z]+"),  # a source without a kind
        common_pb2.Constraint(kind=99, source="x"),
    ],
)
def test_a_constraint_that_cannot_run_is_invalid_argument(router, expect_status, constraint):
    request = router_pb2.GenerateRequest(prompt="Hi", max_new_tokens=4, constraint=constraint)
    details = expect_status(grpc.StatusCode.INVALID_ARGUMENT, router.Generate, request)
    assert "constraint" in details or "schema" in details or "regex" in details


def test_ignore_eos_with_a_constraint_is_invalid_argument(router, expect_status):
    constraint = constraint_to_pb(Constraint(ConstraintKind.JSON_OBJECT))
    request = router_pb2.GenerateRequest(
        prompt="Hi", max_new_tokens=4, ignore_eos=True, constraint=constraint
    )
    assert "ignore_eos" in expect_status(grpc.StatusCode.INVALID_ARGUMENT, router.Generate, request)


def test_the_target_refuses_a_constrained_rebuild_without_its_prompt_length(channels, expect_status):
    target = target_pb2_grpc.TargetServiceStub(channels["target"])
    request = target_pb2.PrefillRequest(
        session_id="constrained-rebuild",
        token_ids=[1, 2, 3],
        root_token=4,
        capacity=256,
        constraint=constraint_to_pb(Constraint(ConstraintKind.JSON_OBJECT)),
    )
    assert "num_prompt_tokens" in expect_status(grpc.StatusCode.INVALID_ARGUMENT, target.Prefill, request)


def test_the_draft_refuses_a_constraint_without_its_prompt_length(shared_stack, channels, expect_status):
    draft = draft_pb2_grpc.DraftServiceStub(channels["draft"])
    request = draft_pb2.DraftPrefillRequest(
        session_id="constrained-draft",
        method="glide-cape",
        token_ids=[1, 2, 3],
        target_address=shared_stack.address("target"),
        capacity=256,
        constraint=constraint_to_pb(Constraint(ConstraintKind.JSON_OBJECT)),
    )
    assert "num_prompt_tokens" in expect_status(grpc.StatusCode.INVALID_ARGUMENT, draft.Prefill, request)
