"""The HTTP API's bound on a body's bytes, derived from the served model's prompt bound (body.py): the
router's `http_max_body_bytes` unless prompts of `max_prompt_tokens` need less."""

from __future__ import annotations

from services.router.http.body import MAX_JSON_BYTES_PER_CHAR, OTHER_FIELDS_BYTES, BodyBounds

MIB = 1024 * 1024


def test_the_configured_limit_holds_when_prompts_may_be_larger() -> None:
    # the default model: 1536 tokens of at most 81 characters, up to 12 bytes each in JSON
    assert BodyBounds.of(1536, 81, MIB).max_body_bytes == MIB


def test_a_small_prompt_bound_lowers_the_body_limit() -> None:
    bounds = BodyBounds.of(max_prompt_tokens=64, max_token_chars=16, http_max_body_bytes=MIB)
    assert bounds.max_body_bytes == 64 * 16 * MAX_JSON_BYTES_PER_CHAR + OTHER_FIELDS_BYTES < MIB
