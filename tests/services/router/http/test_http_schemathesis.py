"""Schemathesis against the router's served /openapi.json: requests generated from the document itself,
valid ones and invalid ones, sent to the real HTTP API in front of the real stack (http_router).

Every response must be one the document declares (status code, content type, body schema), invalid
requests must be refused with a 4xx, and no response may be a 5xx. Bounded for CI: MAX_EXAMPLES requests
per operation and kind, no shrinking (a failure is reported as found), a time limit per operation, and
valid generations held to a few tokens so that each costs well under a second.

schemathesis's own pytest integration is not used (it is off in pyproject.toml's addopts): its lazy
loader, the one that takes a schema from a running server, does not work with this pytest. Hypothesis
runs its strategies directly instead, as schemathesis documents for tests of one's own.
"""

from __future__ import annotations

from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import CHECKS
from schemathesis.schemas import APIOperation, BaseSchema

pytestmark = [pytest.mark.distributed, pytest.mark.model]

MAX_EXAMPLES = 8  # generated requests per operation and generation mode (CI time)
MAX_NEW_TOKENS = 4  # a valid generation stops here: bounded cost whatever was generated
MIN_TIMEOUT_SECONDS = 60.0  # a valid `timeout_seconds` is raised to this: a 504 would then be the test's
SECONDS_PER_OPERATION = 300
# What the served document lists; a route added to the API without being added here fails the first test.
OPERATIONS = [
    "GET /",
    "GET /health",
    "GET /v1/models",
    "GET /v1/models/{model_id}",
    "GET /v1/methods",
    "GET /v1/streams/{stream_id}",
    "POST /v1/chat/completions",
    "POST /v1/completions",
]
# The document states what this router accepts (the served model's bounds included), so a request it
# calls valid must be accepted and one it calls invalid refused.
CHECK_NAMES = (
    "not_a_server_error",  # no 5xx
    "positive_data_acceptance",  # a request the document allows gets a 2xx (or 404 for an unknown id)
    "status_code_conformance",  # every status is one the operation declares
    "content_type_conformance",  # ... with a declared content type
    "response_schema_conformance",  # ... and a body its schema allows
    "response_headers_conformance",
    "negative_data_rejection",  # an invalid request (body, path, token) gets a 4xx
)


@pytest.fixture(scope="module")
def auth(http_router) -> dict[str, str]:
    return {"Authorization": f"Bearer {http_router.token}"}


@pytest.fixture(scope="module")
def served_schema(http_router, auth: dict[str, str]) -> BaseSchema:
    return schemathesis.openapi.from_url(
        f"{http_router.base_url.removesuffix('/v1')}/openapi.json", headers=auth
    )


# Whether a schema, regex or grammar compiles is the engine's to say (the document cannot): a valid
# request's structured-output fields are dropped (test_http_structured.py and
# test_http_structured_openai.py test them). An invalid request keeps them, so it stays invalid.
STRUCTURED_FIELDS = ("response_format", "structured_outputs", "tools", "tool_choice", "parallel_tool_calls")


def bounded(case: schemathesis.Case, mode: schemathesis.GenerationMode) -> None:
    """Holds a generated body's valid token counts and timeout to cheap values. A value the API must
    refuse is left as generated, so an invalid request stays invalid."""
    body = case.body
    if not isinstance(body, dict):
        return
    if mode is schemathesis.GenerationMode.POSITIVE:
        for key in STRUCTURED_FIELDS:
            body.pop(key, None)
        # The prompt's bound in tokens is the model's (the document bounds no token count): a history of
        # dozens of generated calls would pass it. One call per message keeps each message valid.
        for message in body.get("messages") or ():
            if isinstance(message, dict) and isinstance(message.get("tool_calls"), list):
                del message["tool_calls"][1:]
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        # an integer, or an integral number such as 1e3 (JSON Schema's integer too)
        if type(value) in (int, float) and value == int(value) and value > MAX_NEW_TOKENS:
            body[key] = MAX_NEW_TOKENS
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:  # absent or null
        body["max_tokens"] = MAX_NEW_TOKENS
    timeout = body.get("timeout_seconds")
    if type(timeout) in (int, float) and 0 < timeout < MIN_TIMEOUT_SECONDS:
        body["timeout_seconds"] = MIN_TIMEOUT_SECONDS


def fuzz(operation: APIOperation, mode: schemathesis.GenerationMode, headers: dict[str, str]) -> Counter[int]:
    """Sends MAX_EXAMPLES generated requests and checks each response; returns how many got each status."""
    checks = CHECKS.get_by_names(CHECK_NAMES)

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=MAX_EXAMPLES,
        phases=[Phase.generate],  # no shrinking, no replay database
        deadline=None,  # real requests: their time is bounded by the test's timeout instead
        derandomize=True,  # the same requests every run, so a failure reproduces
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )
    def run(case: schemathesis.Case) -> None:
        bounded(case, mode)
        response = case.call_and_validate(headers=headers, checks=checks, timeout=120)
        statuses[response.status_code] += 1

    statuses: Counter[int] = Counter()
    run()
    return statuses


def test_every_served_operation_is_fuzzed(served_schema: BaseSchema) -> None:
    served = [op.ok().label for op in served_schema.get_all_operations()]
    assert sorted(served) == sorted(OPERATIONS)


@pytest.mark.timeout(SECONDS_PER_OPERATION)
@pytest.mark.parametrize("label", OPERATIONS)
def test_generated_requests_get_declared_responses_and_no_5xx(
    served_schema: BaseSchema, auth: dict[str, str], label: str
) -> None:
    method, path = label.split(" ", 1)
    operation = served_schema[path][method]
    valid = fuzz(operation, schemathesis.GenerationMode.POSITIVE, auth)
    if method == "POST":  # the valid requests reached the model, not only the refusals
        assert valid[200] >= MAX_EXAMPLES // 4, dict(valid)
    if operation.body or operation.path_parameters or operation.definition.raw.get("security"):
        # something to get wrong: the body, a path parameter, or the token (missing or malformed)
        fuzz(operation, schemathesis.GenerationMode.NEGATIVE, auth)
