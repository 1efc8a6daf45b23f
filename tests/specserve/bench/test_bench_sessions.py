"""The session workloads' bookkeeping (bench/sessions.py) on a fake engine with a fake prefix cache:
conversations carry their answers into the next turn, documents are asked each question alone, every
cache setting starts cold, and the summary compares on with off."""

from __future__ import annotations

import pytest

from specserve.bench import sessions
from specserve.core.request import GenerationRequest
from specserve.models import load_tokenizer
from specserve.results import FinishReason, GenerationResult, GenerationStats

BLOCK = 256


class PrefixEngine:
    """Answers a fixed text; with a cache, reports whole blocks of the longest prompt prefix seen."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.seen: list[list[int]] | None = None
        self.prompts: list[list[int]] = []

    def reset_prefix_cache(self, budget_bytes: int) -> None:
        self.seen = [] if budget_bytes else None

    def generate_ids(self, ids, request, on_tokens=None) -> GenerationResult:
        self.prompts.append(list(ids))
        cached = 0
        if self.seen is not None:
            for old in self.seen:
                shared = next(
                    (i for i, (a, b) in enumerate(zip(old, ids, strict=False)) if a != b),
                    min(len(old), len(ids)),
                )
                cached = max(cached, min(shared, len(ids) - 1) // BLOCK * BLOCK)
            self.seen.append(list(ids))
        tokens = [7, 8, 9]
        if on_tokens is not None:
            on_tokens(tokens)
        stats = GenerationStats(num_generated_tokens=3, num_target_forwards=1, num_cached_tokens=cached)
        return GenerationResult(tokens, "An answer.", FinishReason.LENGTH, stats)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


def test_doc_qa_asks_every_question_after_the_whole_document(tokenizer) -> None:
    scripts = sessions.doc_qa_scripts(tokenizer, limit=2)
    assert len(scripts) == 2
    assert all(len(tokenizer.encode(s.document)) >= sessions.DOC_TOKENS - 5 for s in scripts)
    engine = PrefixEngine(tokenizer)
    request = GenerationRequest.build(method="target", max_new_tokens=3)
    result = sessions.run_session_workload(engine, scripts[:1], ["target"], request, ("off", "on"), 1 << 20)
    summary = result["target"]["summary"]
    assert summary["off"]["cached_tokens"] == 0
    assert summary["on"]["requests"] == len(sessions.DOC_QUESTIONS)
    # The first question sees the document cold; the three others take its whole blocks.
    turns = result["target"]["turns"]["on"]
    assert turns[0]["cached_tokens"] == 0
    assert all(t["cached_tokens"] >= 5 * BLOCK for t in turns[1:])
    assert summary["on"]["identical_to_off"] == len(sessions.DOC_QUESTIONS)
    assert "tokens_per_s_on_over_off" in summary and "later_turn_ttft_on_over_off" in summary
    assert "tok/s on/off" in sessions.format_sessions(result)


def test_a_conversations_second_turn_carries_the_first_answer(tokenizer) -> None:
    script = sessions.Script("chat", ("First question?", "Second question?"))
    engine = PrefixEngine(tokenizer)
    engine.reset_prefix_cache(0)
    request = GenerationRequest.build(method="target", max_new_tokens=3)
    turns = sessions.run_script(engine.generate_ids, tokenizer, script, request)
    assert [t.turn for t in turns] == [0, 1]
    second = tokenizer.decode(engine.prompts[1])
    assert "First question?" in second and "An answer." in second and "Second question?" in second


def test_multi_turn_takes_both_mt_bench_turns() -> None:
    scripts = sessions.multi_turn_scripts(None, limit=3)
    assert len(scripts) == 3 and all(len(s.turns) == 2 and s.document is None for s in scripts)


def test_a_conversation_over_a_document_opens_with_it_once_and_carries_every_answer(tokenizer) -> None:
    [script] = sessions.doc_qa_scripts(tokenizer, limit=1, conversation=True)
    engine = PrefixEngine(tokenizer)
    engine.reset_prefix_cache(1 << 20)
    request = GenerationRequest.build(method="target", max_new_tokens=3)
    turns = sessions.run_script(engine.generate_ids, tokenizer, script, request)
    assert [t.turn for t in turns] == list(range(len(sessions.DOC_QUESTIONS)))
    last = tokenizer.decode(engine.prompts[-1])
    assert last.count(script.document[:200]) == 1  # the document once, in the first turn
    assert all(question in last for question in sessions.DOC_QUESTIONS)
    assert last.count("An answer.") == len(sessions.DOC_QUESTIONS) - 1
    # each turn extends the previous request, so it reuses every whole block of it
    for before, after in zip(engine.prompts, engine.prompts[1:], strict=False):
        assert after[: len(before)] == before
    assert all(t.cached_tokens >= 5 * BLOCK for t in turns[1:])
