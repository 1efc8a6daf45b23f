"""The engine's prefix cache on the real default model: every output, greedy and sampled, over document
questions and a second chat turn, equals the output with the cache off, token for token, while the
repeated requests take whole prefill chunks from the cache."""

from __future__ import annotations

import json

import pytest

from specserve.bench.workloads import GROUNDED_PATH
from specserve.core.request import GenerationRequest
from specserve.models.chat import encode_messages
from specserve.runtime.target import DEFAULT_PREFILL_CHUNK

pytestmark = [pytest.mark.model, pytest.mark.compute_only, pytest.mark.timeout(600)]

MAX_NEW_TOKENS = 24
BUDGET = 256 * 1024 * 1024
QUESTIONS = ("Summarize it in one sentence.", "Which names does it define?")


@pytest.fixture(scope="module")
def document() -> str:
    """The longest grounded prompt's text (~660 tokens): real prose and code, two prefill chunks."""
    turns = [json.loads(line)["turns"][0] for line in GROUNDED_PATH.read_text().splitlines() if line]
    return max(turns, key=len)


def run(engine, messages: list[dict[str, str]], method: str, temperature: float = 0.0):
    ids = encode_messages(engine.tokenizer, messages, add_generation_prompt=True)
    request = GenerationRequest.build(
        method=method, max_new_tokens=MAX_NEW_TOKENS, temperature=temperature, seed=5
    )
    return engine.generate_ids(ids, request)


@pytest.mark.parametrize(
    ("method", "temperature"),
    [("target", 0.0), ("eagle-cape-suffix", 0.0), ("glide-cape", 0.8), ("suffix", 0.8)],
)
def test_outputs_are_the_same_with_the_cache_on_and_off(default_engine, document, method, temperature):
    user = [{"role": "user", "content": f"{document}\n\n{q}"} for q in QUESTIONS]
    try:
        default_engine.reset_prefix_cache(0)
        assert default_engine.prompt_index_cache is None
        cold = [run(default_engine, [m], method, temperature) for m in user]
        first_turn = cold[0].text
        second = [
            user[0],
            {"role": "assistant", "content": first_turn},
            {"role": "user", "content": "Shorter."},
        ]
        cold.append(run(default_engine, second, method, temperature))

        default_engine.reset_prefix_cache(BUDGET)
        warm = [run(default_engine, [m], method, temperature) for m in user]
        warm.append(run(default_engine, second, method, temperature))
        # Suffix candidates start from the prompts' indexes kept with the K/V (and propose the same).
        indexed = default_engine.prompt_index_cache.held_tokens
        assert (indexed >= 2 * DEFAULT_PREFILL_CHUNK) == ("suffix" in method)
    finally:
        default_engine.reset_prefix_cache(BUDGET)
    assert [r.token_ids for r in warm] == [r.token_ids for r in cold]
    assert all(r.stats.num_cached_tokens == 0 for r in cold)
    assert warm[0].stats.num_cached_tokens == 0  # the first sight of the document
    for later in warm[1:]:
        assert later.stats.num_cached_tokens >= 2 * DEFAULT_PREFILL_CHUNK
