"""The prompt index cache: a tenant's later prompt indexes only what follows the longest block-aligned
prefix it sent before, with the same proposals as an index built alone; tenants never share; the
spans held stay within the budget, and a session in flight keeps reading what was evicted."""

from __future__ import annotations

import random

import pytest
from threads import errors_in_threads

from specserve.core.prompt_indexes import PromptIndexCache, block_digests
from specserve.core.suffix import SuffixIndex
from specserve.errors import InvalidArgument

BLOCK = 16
ASKS = ((1, 1), (4, 8), (8, 24))
rng = random.Random(7)
DOCUMENT = [rng.randrange(50) for _ in range(150)]  # ~9 blocks, small vocabulary: many matches


def new_index() -> SuffixIndex:
    return SuffixIndex(max_match=8, max_occurrences=8, max_tokens=4096)


def question(seed: int, length: int = 20) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(50) for _ in range(length)]


def started(cache: PromptIndexCache, tenant: str, prompt: list[int]) -> tuple[SuffixIndex, int]:
    index = new_index()
    return index, cache.start(index, tenant, prompt)


def assert_same_as_alone(index: SuffixIndex, stream: list[int]) -> None:
    alone = new_index()
    alone.extend(stream)
    for depth, nodes in ASKS:
        assert index.propose(depth, nodes) == alone.propose(depth, nodes)


def test_a_later_question_over_one_document_indexes_only_what_follows_it():
    counted: list[tuple[int, int]] = []
    cache = PromptIndexCache(4096, block_tokens=BLOCK, on_start=lambda *c: counted.append(c))
    first = DOCUMENT + question(1)
    index, reused = started(cache, "alice", first)
    assert reused == 0 and index.shared_tokens == len(first) // BLOCK * BLOCK
    second = DOCUMENT + question(2)
    index, reused = started(cache, "alice", second)
    assert reused == len(DOCUMENT) // BLOCK * BLOCK  # the whole blocks both prompts share
    assert counted == [(0, len(first)), (reused, len(second) - reused)]
    for new in question(3, 30):  # and the session goes on as an index built alone would
        assert_same_as_alone(index, second)
        second.append(new)
        index.extend([new])


def test_a_conversation_chains_its_turns_and_a_long_chain_is_indexed_again():
    cache = PromptIndexCache(1 << 16, block_tokens=BLOCK, max_spans=3)
    conversation = list(DOCUMENT[:40])
    lengths = []
    for turn in range(6):
        conversation += question(turn, 37)
        index, reused = started(cache, "alice", conversation)
        lengths.append(len(index._prefix.spans))
        rebuilt = turn in (0, 3)  # the first turn, and the one a fourth span would have made too long
        assert reused == (0 if rebuilt else (len(conversation) - 37) // BLOCK * BLOCK)
        assert_same_as_alone(index, conversation)
    assert lengths == [1, 2, 3, 1, 2, 3]  # a fourth span would be one too many: one span again


def test_tenants_never_share_and_equal_digests_need_equal_tokens():
    cache = PromptIndexCache(4096, block_tokens=BLOCK)
    prompt = DOCUMENT + question(1)
    started(cache, "alice", prompt)
    assert started(cache, "bob", prompt)[1] == 0
    assert started(cache, "", prompt)[1] == 0
    assert started(cache, "alice", prompt)[1] == len(prompt) // BLOCK * BLOCK
    # Digests cover the tenant and every token before the block's end.
    assert block_digests("alice", prompt, BLOCK, 3) != block_digests("bob", prompt, BLOCK, 3)
    changed = [prompt[0] + 1, *prompt[1:]]
    assert block_digests("alice", changed, BLOCK, 3)[2] != block_digests("alice", prompt, BLOCK, 3)[2]


def test_the_budget_holds_under_a_flood_and_sessions_in_flight_keep_their_spans():
    budget = 600
    cache = PromptIndexCache(budget, block_tokens=BLOCK)
    early = DOCUMENT + question(0)
    in_flight, _ = started(cache, "alice", early)
    for i in range(40):  # distinct long prompts
        started(cache, f"tenant-{i % 3}", question(100 + i, 200))
        assert cache.held_tokens <= budget
    assert started(cache, "alice", early)[1] == 0  # evicted: indexed again
    for new in question(5, 20):  # the evicted spans still serve the session that started from them
        assert_same_as_alone(in_flight, early)
        early.append(new)
        in_flight.extend([new])


def test_short_and_over_long_prompts_index_alone():
    cache = PromptIndexCache(4096, block_tokens=BLOCK)
    index, reused = started(cache, "alice", DOCUMENT[: BLOCK - 1])
    assert reused == 0 and index.shared_tokens == 0 and len(cache) == 0
    small = SuffixIndex(max_match=8, max_occurrences=8, max_tokens=64)
    assert cache.start(small, "alice", DOCUMENT) == 0
    assert small.shared_tokens == 0 and small.retained == 64 and len(cache) == 0
    with pytest.raises(InvalidArgument):
        PromptIndexCache(0)


def test_sessions_start_at_once_from_several_threads():
    cache = PromptIndexCache(2000, block_tokens=BLOCK)

    def work(seed: int) -> None:
        for i in range(20):
            prompt = DOCUMENT + question(seed * 100 + i % 4)
            index, _ = started(cache, f"t{seed % 2}", prompt)
            assert_same_as_alone(index, prompt)

    assert not errors_in_threads(work)
    assert cache.held_tokens <= 2000
