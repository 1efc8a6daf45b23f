"""Offline training text: the sources exist, prompts are reproducible, and MT-Bench never leaks in."""

from __future__ import annotations

from specserve.bench.prompts import load_prompts
from specserve.training.corpus import Source, dummy_conversations, read_documents, stdlib_files
from specserve.training.prompts import written_prompts


def test_stdlib_source_excludes_tests() -> None:
    files = stdlib_files()
    assert len(files) > 500
    assert not any("test" in p.parts or "tests" in p.parts for p in files)


def test_read_documents_respects_the_character_budget() -> None:
    texts = list(read_documents(Source.STDLIB, max_chars=5000, seed=1))
    assert sum(len(t) for t in texts) == 5000
    assert texts == list(read_documents(Source.STDLIB, max_chars=5000, seed=1))


def test_dummy_conversations_alternate_user_and_assistant() -> None:
    conversations = dummy_conversations()
    assert len(conversations) == 500
    for conversation in conversations:
        assert [m["role"] for m in conversation] == ["user", "assistant"] * (len(conversation) // 2)


def test_written_prompts_are_distinct_and_reproducible() -> None:
    prompts = written_prompts(600, seed=0)
    assert len(prompts) == len(set(prompts)) == 600
    assert prompts == written_prompts(600, seed=0)
    assert prompts != written_prompts(600, seed=1)


def test_no_mt_bench_question_is_a_training_prompt() -> None:
    """MT-Bench is evaluation data: none of its first turns (nor a long piece of one) may be trained on."""
    training = written_prompts(10**6) + [m["content"] for c in dummy_conversations() for m in c]
    training_text = "\n".join(training)
    for prompt in load_prompts():
        assert prompt.text[:60] not in training_text, prompt.question_id
