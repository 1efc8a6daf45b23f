"""Many sessions at once through the real stack: continuous batching in the target and the draft.

32 sessions stream at the same time (the target serves their rounds in shared forwards); every one must
produce exactly the tokens its prompt produces alone through the same stack, and none may fail.
"""

from __future__ import annotations

import threading

import pytest
from threads import errors_in_threads

from specserve.catalog import DEFAULT_METHOD
from specserve.client import Client

pytestmark = [pytest.mark.distributed, pytest.mark.model, pytest.mark.timeout(600)]

PROMPTS = (
    "Explain what a hash table is.",
    "Write a haiku about autumn rain.",
    "What is 17 times 23?",
    "Name three planets.",
    "Give me a tip for learning Python.",
    "What does a compiler do?",
    "Describe the colour blue to a child.",
    "Why is the sky dark at night?",
)
SESSIONS = 32
MAX_NEW_TOKENS = 16


def test_32_concurrent_sessions_equal_their_runs_alone(shared_stack):
    method = DEFAULT_METHOD  # batched verify in the target and batched drafting in the draft
    with Client(shared_stack.address("router")) as client:
        alone = {
            p: client.generate(p, method=method, max_new_tokens=MAX_NEW_TOKENS, timeout=120).token_ids
            for p in PROMPTS
        }
        outputs: list[list[int] | None] = [None] * SESSIONS
        finish: list[str] = [""] * SESSIONS
        barrier = threading.Barrier(SESSIONS)

        def run(i: int) -> None:
            barrier.wait()
            prompt = PROMPTS[i % len(PROMPTS)]
            completion = client.generate(prompt, method=method, max_new_tokens=MAX_NEW_TOKENS, timeout=300)
            outputs[i] = completion.token_ids
            finish[i] = completion.finish_reason

        errors = errors_in_threads(run, SESSIONS)  # under load, no request may fail
    assert not errors, errors[:3]
    for i, output in enumerate(outputs):
        expected = alone[PROMPTS[i % len(PROMPTS)]]
        assert output == expected, f"session {i} ({finish[i]}) differs from its run alone"
