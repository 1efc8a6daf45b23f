"""The router tokenizes and detokenizes exactly as the engine does, from the target's ModelInfo alone.

The ModelInfo comes from the target servicer's own GetModelInfo (in-process, on the default model), so
the router side sees just what it would receive over the wire.
"""

from __future__ import annotations

import random

import pytest

from services.router.tokenizer import IncrementalText, RouterTokenizer
from specserve.errors import InvalidArgument
from specserve.runtime.prefix_cache import FINE_BLOCK_TOKENS
from specserve.v1 import target_pb2

pytestmark = pytest.mark.model

PROMPTS = [
    "What is the capital of France?",
    "Crème brûlée, naïve café, Ærøskøbing, 日本語のテキスト, Привет, مرحبا",
    "Emoji: 🚀🔥👍🏽 and a family 👨‍👩‍👧 and flags 🇫🇷🇯🇵",
    "line one\nline two\n\n  indented line\ttab\r\nwindows line\n",
    "Template-like: {{ messages }} {% for m in messages %}{{ m }}{% endfor %} {# comment #} ${x} %s {}",
    "Chat markers as text: <|im_start|>user\nhi<|im_end|> <|endoftext|> </s> [INST]",
    "   leading and trailing spaces   ",
    "a" * 500,
]
# Multi-byte characters that byte-level BPE splits over several tokens.
MULTI_BYTE_TEXT = "Hi 👋🏽! Tea 🍵 or 日本茶? Ça va. 🧑‍🚀 done 🎉"


@pytest.fixture(scope="module")
def model_info(default_engine) -> target_pb2.ModelInfo:
    from services.target.servicer import TargetServicer
    from specserve.serving.metrics import TargetMetrics
    from specserve.serving.settings import TargetServiceSettings

    servicer = TargetServicer(default_engine, TargetServiceSettings(), TargetMetrics.create())
    info = servicer.GetModelInfo(target_pb2.GetModelInfoRequest(), None)
    # What the router gets over the wire: a serialized copy.
    return target_pb2.ModelInfo.FromString(info.SerializeToString())


@pytest.fixture(scope="module")
def tokenizer(model_info) -> RouterTokenizer:
    return RouterTokenizer(model_info)


def test_model_info_carries_a_chat_template_and_tokenizer(model_info):
    assert model_info.chat_template and model_info.tokenizer_json
    assert model_info.eos_token == "<|im_end|>"


def test_model_info_gives_the_prefix_cache_block_before_anything_is_cached(model_info, default_engine):
    # A fresh target's cache is empty; the router reads this once, on its first request, to route by
    # prefix (a 0 here turned prefix routing off for the router's lifetime). The block is the prefill
    # chunk, or finer where the target's rows do not depend on the chunk (runtime/prefix_cache.py).
    expected = FINE_BLOCK_TOKENS if default_engine.target_runner.rows_independent else 256
    assert model_info.prefix_cache_block_tokens == expected


@pytest.mark.parametrize("prompt", PROMPTS, ids=range(len(PROMPTS)))
def test_encode_prompt_equals_the_engine(tokenizer, default_engine, prompt):
    assert tokenizer.encode_prompt(prompt) == default_engine.encode_prompt(prompt)


def test_empty_prompt_is_invalid_in_both(tokenizer, default_engine):
    for prompt in ("", "  \n\t"):
        with pytest.raises(InvalidArgument):
            tokenizer.encode_prompt(prompt)
        with pytest.raises(InvalidArgument):
            default_engine.encode_prompt(prompt)


def test_decode_equals_the_engine(tokenizer, default_engine, model_info):
    sequences = [default_engine.encode_prompt(p) for p in PROMPTS]  # with special tokens, skipped by both
    rng = random.Random(0)
    sequences += [[rng.randrange(model_info.vocab_size) for _ in range(n)] for n in (1, 7, 64, 300)]
    sequences.append([])
    for token_ids in sequences:
        assert tokenizer.decode(token_ids) == default_engine.decode(token_ids)


def multi_byte_ids(tokenizer: RouterTokenizer) -> list[int]:
    ids = tokenizer.tokenizer.encode(MULTI_BYTE_TEXT, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == MULTI_BYTE_TEXT
    return ids


def stream(incremental: IncrementalText, token_ids: list[int], chunk: int, final: bool) -> list[str]:
    deltas = []
    for start in range(0, len(token_ids), chunk):
        deltas.append(incremental.add(token_ids[start : start + chunk]))
    if final:
        deltas.append(incremental.add([], final_text=incremental.tokenizer.decode(incremental.token_ids)))
    return deltas


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_incremental_text_never_emits_half_a_character(tokenizer, chunk):
    token_ids = multi_byte_ids(tokenizer)
    deltas = stream(IncrementalText(tokenizer), token_ids, chunk, final=True)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == MULTI_BYTE_TEXT
    if chunk == 1:  # some character spans several tokens: its first tokens add no text
        assert "" in deltas[:-1]


def test_incremental_text_without_a_final_message_still_completes(tokenizer):
    deltas = stream(IncrementalText(tokenizer), multi_byte_ids(tokenizer), 1, final=False)
    assert "".join(deltas) == MULTI_BYTE_TEXT


@pytest.mark.parametrize("chunk", [1, 3])
def test_resumed_incremental_text_completes_what_the_client_has(tokenizer, chunk):
    """The router resumes with IncrementalText(tokenizer, received): at every cut, even one inside a
    character, the client's text so far plus the resumed deltas is the whole text."""
    token_ids = multi_byte_ids(tokenizer)
    for cut in range(0, len(token_ids) + 1, chunk):
        client_text = "".join(stream(IncrementalText(tokenizer), token_ids[:cut], chunk, final=False))
        resumed = stream(IncrementalText(tokenizer, token_ids[:cut]), token_ids[cut:], chunk, final=True)
        assert all("\ufffd" not in d for d in resumed), cut
        assert client_text + "".join(resumed) == MULTI_BYTE_TEXT, f"resumed after {cut} tokens"
