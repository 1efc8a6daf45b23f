"""A draft model's own prompt K/V in the prefix cache (a vanilla draft's, a GliDe draft's, a hidden-state
draft's layer): a request starts its draft from the cached prefix, and its drafts, and the target's
acceptance of them, are those of a cold draft.

The draft catches its cache up in chunks at absolute multiples of the block, cache or not, so a cached
block is exactly what a cold catch-up computes there. The target's cache is on in every run: only the
draft's blocks are switched.
"""

from __future__ import annotations

import pytest
import torch

from specserve.core.finish import FinishChecker
from specserve.core.loop import speculative_generate
from specserve.core.protocols import RoundOutcome
from specserve.eagle.drafter import EagleDrafter
from specserve.eagle.model import build_eagle
from specserve.errors import InvalidArgument
from specserve.glide import GlideDrafter, build_glide
from specserve.runtime.drafter import DraftShape, ModelDrafter, chunk_bounds
from specserve.runtime.prefix_cache import DraftPrefix, PrefixCache
from specserve.runtime.target import LocalVerifier

CHUNK = 8
CAPACITY = 256
DOCUMENT = [(7 * i + 3) % 60 + 2 for i in range(37)]  # four whole blocks and five tokens
SHAPE = DraftShape(depth=3, widths=(2,))


def generate(target, draft, cache: PrefixCache, prompt: list[int], draft_cached: bool, tenant: str = ""):
    """(generated tokens, per round the tree drafted and the nodes accepted, the drafter)."""
    verifier = LocalVerifier(target, CAPACITY, prefill_chunk=CHUNK, prefix_cache=cache)
    prefix = DraftPrefix.of(cache if draft_cached else None, "vanilla", tenant)
    drafter = ModelDrafter(draft, CAPACITY, SHAPE, verifier.sampling, prefix=prefix, prefill_chunk=CHUNK)
    return (*run_loop(prompt, verifier, drafter), drafter)


def run_loop(prompt: list[int], verifier: LocalVerifier, drafter) -> tuple[list[int], list]:
    """24 tokens; (generated tokens, per round the tree drafted and the nodes accepted)."""
    rounds: list[tuple[object, tuple[int, ...]]] = []

    def on_round(outcome: RoundOutcome) -> None:
        rounds.append((outcome.draft.tree, outcome.accepted_nodes))

    finish = FinishChecker(max_new_tokens=24)
    speculative_generate(prompt, verifier, drafter, 0, finish, on_round=on_round)
    return list(finish.generated), rounds


def draft_kv(drafter: ModelDrafter, positions: int) -> list[torch.Tensor]:
    return [torch.cat(drafter.cache.layer_kv(i))[:, :, :positions] for i in range(drafter.runner.num_layers)]


def test_a_draft_from_its_cached_prefix_drafts_and_is_accepted_as_a_cold_one(target, draft):
    question = [*DOCUMENT, 9, 10, 11]
    runs = {}
    for draft_cached in (False, True):
        cache = PrefixCache(1 << 30, CHUNK)
        generate(target, draft, cache, [*DOCUMENT, 5, 6], draft_cached)  # the first request fills it
        hits = cache.stats.hit_tokens
        runs[draft_cached] = (
            *generate(target, draft, cache, question, draft_cached),
            cache.stats.hit_tokens - hits,
        )
    cold_tokens, cold_rounds, _, cold_hits = runs[False]
    warm_tokens, warm_rounds, _, warm_hits = runs[True]
    assert warm_tokens == cold_tokens
    assert warm_rounds == cold_rounds  # the same trees, the same nodes accepted
    assert any(len(accepted) > 1 for _, accepted in warm_rounds)
    assert warm_hits - cold_hits == 32  # the draft's lookup found the document's whole blocks


def test_the_cached_draft_kv_equals_a_cold_catch_up(target, draft):
    cache = PrefixCache(1 << 30, CHUNK)
    prefix = DraftPrefix.of(cache, "vanilla")
    first = ModelDrafter(draft, CAPACITY, SHAPE, prefix=prefix, prefill_chunk=CHUNK)
    first.propose([*DOCUMENT, 5], 0, 1)
    warm = ModelDrafter(draft, CAPACITY, SHAPE, prefix=prefix, prefill_chunk=CHUNK)
    cold = ModelDrafter(draft, CAPACITY, SHAPE, prefill_chunk=CHUNK)
    token_ids = [*DOCUMENT, 7, 8, 9]
    assert warm.propose(token_ids, 3, 1).tree == cold.propose(token_ids, 3, 1).tree
    for w, c in zip(draft_kv(warm, len(token_ids)), draft_kv(cold, len(token_ids)), strict=True):
        assert torch.equal(w, c)


def test_from_blocks_finer_than_its_chunk_a_draft_loads_whole_chunks(target, draft):
    """Where the target's rows are independent its cache keeps finer blocks; a draft model runs dense, so
    it loads only whole chunks of its own (what a cold catch-up cuts) and drafts as a cold one."""
    cache = PrefixCache(1 << 30, CHUNK // 4)
    prefix = DraftPrefix.of(cache, "vanilla")
    ModelDrafter(draft, CAPACITY, SHAPE, prefix=prefix, prefill_chunk=CHUNK).propose([*DOCUMENT, 5], 0, 1)
    namespace = prefix.namespace
    assert cache.acquire(namespace, DOCUMENT, len(DOCUMENT)).num_tokens == 32  # the inserted whole chunks
    assert cache.acquire(namespace, DOCUMENT, 30, multiple=CHUNK).num_tokens == 24
    warm = ModelDrafter(draft, CAPACITY, SHAPE, prefix=prefix, prefill_chunk=CHUNK)
    cold = ModelDrafter(draft, CAPACITY, SHAPE, prefill_chunk=CHUNK)
    token_ids = [*DOCUMENT, 7, 8, 9]
    assert warm.propose(token_ids, 3, 1).tree == cold.propose(token_ids, 3, 1).tree
    assert warm.blocks.exact == 40  # loaded 32, then caught up to the chunk at 40 like the cold one
    for w, c in zip(draft_kv(warm, len(token_ids)), draft_kv(cold, len(token_ids)), strict=True):
        assert torch.equal(w, c)
    with pytest.raises(InvalidArgument, match="must tile its chunk"):
        ModelDrafter(
            draft, CAPACITY, SHAPE, prefix=DraftPrefix.of(PrefixCache(1 << 20, 3), "v"), prefill_chunk=CHUNK
        )


def test_a_tenant_or_another_draft_never_reads_these_blocks(target, draft):
    cache = PrefixCache(1 << 30, CHUNK)
    ModelDrafter(
        draft, CAPACITY, SHAPE, prefix=DraftPrefix.of(cache, "vanilla", "a"), prefill_chunk=CHUNK
    ).propose([*DOCUMENT, 5], 0, 1)
    assert cache.acquire(repr(("draft", "vanilla", "a")), DOCUMENT, len(DOCUMENT)).num_tokens == 32
    for namespace in (repr(("draft", "vanilla", "b")), repr(("draft", "eagle", "a")), ""):
        assert cache.acquire(namespace, DOCUMENT, len(DOCUMENT)).num_tokens == 0  # "": the target's


def test_positions_fed_after_a_rejection_are_never_cached(target, draft):
    cache = PrefixCache(1 << 30, CHUNK)
    drafter = ModelDrafter(
        draft, CAPACITY, SHAPE, prefix=DraftPrefix.of(cache, "vanilla"), prefill_chunk=CHUNK
    )
    short = DOCUMENT[:5]
    drafter.propose(short, 0, 1)  # one chunk, not whole
    assert len(cache) == 0
    drafter.propose([*short, *DOCUMENT[5:20]], 1, 1)  # fed from 5, not from an exact end: not exact
    assert len(cache) == 0


def test_the_catch_up_is_cut_where_a_prefill_cuts():
    assert chunk_bounds(0, 20, CHUNK) == [(0, 8), (8, 16), (16, 20)]
    assert chunk_bounds(16, 21, CHUNK) == [(16, 21)]
    assert chunk_bounds(5, 9, CHUNK) == [(5, 8), (8, 9)]


def eagle_generate(
    target, eagle, cache: PrefixCache, prompt: list[int], draft_cached: bool, told: bool = True
):
    """As `generate`, with a hidden-state draft reading the target's cached features."""
    verifier = LocalVerifier(target, CAPACITY, prefill_chunk=CHUNK, prefix_cache=cache)
    prefix = DraftPrefix.of(cache if draft_cached else None, "eagle")
    drafter = EagleDrafter(eagle, verifier.cache, CAPACITY, SHAPE, None, verifier.sampling, prefix, CHUNK)
    if told:
        drafter.know_prompt(len(prompt))  # what the engine does
    return run_loop(prompt, verifier, drafter)


def second_question(run) -> tuple[list[int], list, int]:
    """`run(cache, prompt)` over the document, then over a second question about it on the same cache:
    the second's (tokens, rounds) and the cache hits it added."""
    cache = PrefixCache(1 << 30, CHUNK)
    run(cache, [*DOCUMENT, 5, 6])
    hits = cache.stats.hit_tokens
    tokens, rounds = run(cache, [*DOCUMENT, 9, 10, 11])
    return tokens, rounds, cache.stats.hit_tokens - hits


def tiny_eagle(target):
    eagle = build_eagle(target.model, seed=0, draft_vocab_size=None)
    eagle.init_weights(torch.Generator().manual_seed(0), std=0.3)
    return eagle


def cold_and_warm(generate) -> tuple[list, int]:
    """The second question asked with the draft's cache off, then on (`generate(cache, prompt,
    draft_cached)`): asserts the same tokens and rounds; returns the warm rounds and the extra cache hits
    the draft's own blocks gave."""
    runs = {
        cached: second_question(lambda c, p, cached=cached: generate(c, p, cached))
        for cached in (False, True)
    }
    cold_tokens, cold_rounds, cold_hits = runs[False]
    warm_tokens, warm_rounds, warm_hits = runs[True]
    assert warm_tokens == cold_tokens
    assert warm_rounds == cold_rounds
    return warm_rounds, warm_hits - cold_hits


def test_a_hidden_state_draft_from_its_cached_prefix_drafts_as_a_cold_one(target):
    eagle = tiny_eagle(target)
    warm_rounds, extra_hits = cold_and_warm(lambda c, p, cached: eagle_generate(target, eagle, c, p, cached))
    assert any(len(accepted) > 1 for _, accepted in warm_rounds)
    # Its blocks key the next tokens x[1..]: the document's 36 after x[0] hold four whole blocks.
    assert extra_hits == 32


def test_a_hidden_state_draft_not_told_its_prompt_caches_nothing(target):
    cache = PrefixCache(1 << 30, CHUNK)
    eagle_generate(target, tiny_eagle(target), cache, [*DOCUMENT, 5, 6], True, told=False)
    prompt_blocks = (len(DOCUMENT) + 2) // CHUNK
    assert len(cache) == prompt_blocks  # the target's blocks only


def glide_generate(target, glide, cache: PrefixCache, prompt: list[int], draft_cached: bool):
    """As `generate`, with a GliDe draft cross-attending the target's cached K/V."""
    verifier = LocalVerifier(target, CAPACITY, prefill_chunk=CHUNK, prefix_cache=cache)
    prefix = DraftPrefix.of(cache if draft_cached else None, "glide")
    drafter = GlideDrafter(glide, verifier.cache, CAPACITY, SHAPE, None, verifier.sampling, prefix, CHUNK)
    drafter.know_prompt(len(prompt))
    return run_loop(prompt, verifier, drafter)


def test_a_glide_draft_from_its_cached_prefix_drafts_as_a_cold_one(target):
    glide = build_glide(target.model, seed=0)
    glide.init_weights(torch.Generator().manual_seed(0), std=0.3)
    warm_rounds, extra_hits = cold_and_warm(lambda c, p, cached: glide_generate(target, glide, c, p, cached))
    assert all(tree.num_nodes > 1 for tree, _ in warm_rounds)
    assert extra_hits == 32
