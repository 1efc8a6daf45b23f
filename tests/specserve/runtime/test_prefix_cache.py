"""The prefix cache: a prefill from a cached prefix equals a cold one bit for bit, per tenant, in budget."""

from __future__ import annotations

import itertools

import pytest
import torch
from tiny_llama import quantize_model, tiny_llama

from specserve.core.finish import FinishChecker
from specserve.core.loop import speculative_generate
from specserve.errors import InvalidArgument
from specserve.runtime.drafter import DraftShape, ModelDrafter
from specserve.runtime.int4 import apply_as_shipped
from specserve.runtime.prefix_cache import FINE_BLOCK_TOKENS, PrefixCache, block_tokens_for
from specserve.runtime.runner import ModelRunner
from specserve.runtime.target import LocalVerifier

CHUNK = 8  # prefill chunk of these tests: prompts of a few dozen tokens span several
CAPACITY = 256
DOCUMENT = [(7 * i + 3) % 60 + 2 for i in range(37)]


def verifier(target, cache: PrefixCache | None, tenant: str = "a") -> LocalVerifier:
    return LocalVerifier(target, CAPACITY, prefill_chunk=CHUNK, prefix_cache=cache, tenant=tenant)


def kv(v: LocalVerifier) -> list[torch.Tensor]:
    return [torch.cat(v.cache.layer_kv(i)) for i in range(v.runner.num_layers)]


def test_a_cached_prefix_prefills_as_a_cold_prompt(target):
    cache = PrefixCache(budget_bytes=1 << 30, block_tokens=CHUNK)
    first = verifier(target, cache)
    first.prefill([*DOCUMENT, 5, 6], 0)
    assert first.cached_tokens == 0

    question = [*DOCUMENT, 9, 10, 11]
    warm, cold = verifier(target, cache), verifier(target, None)
    warm_root, cold_root = warm.prefill(question, 0), cold.prefill(question, 0)
    assert warm.cached_tokens == 32  # whole blocks of the 37 shared tokens
    assert warm_root == cold_root
    for warm_kv, cold_kv in zip(kv(warm), kv(cold), strict=True):
        assert torch.equal(warm_kv, cold_kv)


def test_blocks_must_be_the_prefill_chunk(target):
    # Smaller blocks would start a chunk where a cold prefill does not: the K/V differ in the last bits.
    assert not target.rows_independent
    assert block_tokens_for(target, 4 * FINE_BLOCK_TOKENS) == 4 * FINE_BLOCK_TOKENS
    with pytest.raises(InvalidArgument, match="must equal the prefill chunk"):
        LocalVerifier(target, CAPACITY, prefill_chunk=CHUNK, prefix_cache=PrefixCache(1 << 20, CHUNK // 2))


@pytest.fixture(scope="module")
def rows_independent_target() -> ModelRunner:
    """The tiny Llama on its file's codes and the CPU's kernels (the compiled layers)."""
    from specserve.runtime import cpu_kernels

    if cpu_kernels.library() is None:
        pytest.skip("no C++ compiler on this host")
    model = tiny_llama(vocab_size=64, hidden=32)
    apply_as_shipped(model, quantize_model(model), kernel="int8-dot")
    return ModelRunner(model)


def test_where_rows_are_independent_a_prompt_s_kv_do_not_depend_on_its_chunks(rows_independent_target):
    runner = rows_independent_target
    assert runner.rows_independent
    assert block_tokens_for(runner, 8 * FINE_BLOCK_TOKENS) == FINE_BLOCK_TOKENS
    caches = []
    for cuts in ((0, 8, 16, 24, 32, 37), (0, 3, 11, 12, 30, 37), (0, 37)):
        cache = runner.new_cache(CAPACITY)
        for start, end in itertools.pairwise(cuts):
            runner.forward(cache, DOCUMENT[start:end])
        caches.append([torch.cat(cache.layer_kv(i)) for i in range(runner.num_layers)])
    for other in caches[1:]:
        for want, have in zip(caches[0], other, strict=True):
            assert torch.equal(want, have)


def test_finer_blocks_than_the_chunk_prefill_as_a_cold_prompt_where_rows_are_independent(
    rows_independent_target,
):
    """Blocks of 2 under chunks of 8: a later request reuses all but the odd token of its shared prefix,
    and its K/V and first token are a cold prefill's."""
    cache = PrefixCache(budget_bytes=1 << 30, block_tokens=2)
    first = verifier(rows_independent_target, cache)
    first.prefill([*DOCUMENT, 5, 6], 0)
    question = [*DOCUMENT, 9, 10, 11]
    warm, cold = verifier(rows_independent_target, cache), verifier(rows_independent_target, None)
    warm_root, cold_root = warm.prefill(question, 0), cold.prefill(question, 0)
    assert warm.cached_tokens == 36  # whole blocks of 2 of the 37 shared tokens (chunks of 8: 32)
    assert warm_root == cold_root
    for warm_kv, cold_kv in zip(kv(warm), kv(cold), strict=True):
        assert torch.equal(warm_kv, cold_kv)
    with pytest.raises(InvalidArgument, match="must equal the prefill chunk"):  # blocks must tile the chunk
        verifier(rows_independent_target, PrefixCache(1 << 20, 3))


def test_the_last_prompt_token_is_always_computed(target):
    cache = PrefixCache(1 << 30, CHUNK)
    prompt = DOCUMENT[: 2 * CHUNK]
    verifier(target, cache).prefill(prompt, 0)
    again = verifier(target, cache)
    assert again.prefill(prompt, 0) == verifier(target, None).prefill(prompt, 0)
    assert again.cached_tokens == CHUNK  # the second block holds the last token, whose logits are needed


def test_a_tenant_never_reads_another_tenants_prefix(target):
    cache = PrefixCache(1 << 30, CHUNK)
    verifier(target, cache, tenant="a").prefill(DOCUMENT, 0)
    other = verifier(target, cache, tenant="b")
    other.prefill(DOCUMENT, 0)
    assert other.cached_tokens == 0
    same = verifier(target, cache, tenant="a")
    same.prefill(DOCUMENT, 0)
    assert same.cached_tokens == 32


def test_greedy_generation_is_identical_with_the_cache(target, draft):
    cache = PrefixCache(1 << 30, CHUNK)

    def generate(prefix_cache: PrefixCache | None, prompt: list[int]) -> list[int]:
        v = verifier(target, prefix_cache)
        drafter = ModelDrafter(draft, CAPACITY, DraftShape(depth=3, widths=(2,)), v.sampling)
        finish = FinishChecker(max_new_tokens=24)
        speculative_generate(prompt, v, drafter, 0, finish)
        return list(finish.generated)

    first_turn = generate(cache, DOCUMENT)
    second = [*DOCUMENT, *first_turn, 4, 5, 6]
    assert generate(cache, second) == generate(None, second)
    assert cache.stats.hit_tokens == 32


def test_memory_stays_in_budget_under_a_flood_of_distinct_prompts(target):
    probe = PrefixCache(1 << 30, CHUNK)
    verifier(target, probe).prefill([*DOCUMENT[:CHUNK], 1], 0)
    block_bytes = probe.used_bytes
    cache = PrefixCache(budget_bytes=5 * block_bytes, block_tokens=CHUNK)
    # A session loading a cached prefix pins it: the flood evicts around it.
    verifier(target, cache, tenant="pinned").prefill(DOCUMENT, 0)
    in_flight = verifier(target, cache, tenant="pinned")
    in_flight.prefill([*DOCUMENT, 1], 0)  # started from the cache, before the flood
    lease = cache.acquire("pinned", DOCUMENT, len(DOCUMENT))
    assert lease.num_tokens == 32
    for seed in range(12):
        prompt = [(seed * 13 + 5 * i) % 60 + 2 for i in range(3 * CHUNK + 1)]
        verifier(target, cache, tenant=str(seed)).prefill(prompt, 0)
        assert cache.used_bytes <= cache.budget_bytes
    assert cache.stats.evicted_blocks > 0
    # A session holds its own copy of what it reused: evictions never touch it.
    cold = verifier(target, None)
    cold.prefill([*DOCUMENT, 1], 0)
    assert in_flight.cached_tokens == 32
    for a, b in zip(kv(in_flight), kv(cold), strict=True):
        assert torch.equal(a, b)
    reader = verifier(target, None)
    assert cache.load(lease, reader.cache) == 32  # still whole, though over a budget's worth came since
    cache.release(lease)
    assert cache.used_bytes <= cache.budget_bytes
    # A chain loses its tail first: what is left of any prompt is a prefix of it.
    assert len(cache) <= 5


def test_hidden_state_features_are_cached_with_the_kv(target):
    cache = PrefixCache(1 << 30, CHUNK)
    plain = verifier(target, cache)
    plain.prefill(DOCUMENT, 0)  # caches K/V without features: a feature-keeping session cannot use it
    warm, cold = verifier(target, cache), verifier(target, None)
    for v in (warm, cold):
        v.cache.keep_features()
        v.prefill([*DOCUMENT, 3], 0)
    assert warm.cached_tokens == 0
    assert torch.equal(warm.cache.hidden_states(), cold.cache.hidden_states())
    again = verifier(target, cache)
    again.cache.keep_features()
    again.prefill([*DOCUMENT, 4], 0)  # the first feature-keeping prefill attached its features
    assert again.cached_tokens == 32
    check = verifier(target, None)
    check.cache.keep_features()
    check.prefill([*DOCUMENT, 4], 0)
    assert torch.equal(again.cache.hidden_states(), check.cache.hidden_states())


def test_a_rebuild_starts_from_the_cached_prefix_too(target):
    cache = PrefixCache(1 << 30, CHUNK)
    verifier(target, cache).prefill(DOCUMENT, 0)
    rebuilt = verifier(target, cache)
    rebuilt.resume([*DOCUMENT, 9])
    assert rebuilt.cached_tokens == 32
    cold = verifier(target, None)
    cold.resume([*DOCUMENT, 9])
    for a, b in zip(kv(rebuilt), kv(cold), strict=True):
        assert torch.equal(a, b)
