"""The suffix drafter against brute-force references on small vocabularies, where matches are frequent."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from threads import errors_in_threads

from specserve.core.suffix import SharedSuffixCache, SuffixIndex, SuffixProposal, merge_proposals
from specserve.core.tree import TokenTree, tree_depths
from specserve.errors import InvalidArgument

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def paths(tree: TokenTree) -> list[tuple[int, ...]]:
    """Each node's tokens below the root, root first: ()."""
    out: list[tuple[int, ...]] = [()]
    for i in range(1, tree.num_nodes):
        out.append((*out[tree.parent_ids[i]], tree.token_ids[i]))
    return out


def assert_trie(tree: TokenTree) -> None:
    pairs = [(tree.parent_ids[i], tree.token_ids[i]) for i in range(1, tree.num_nodes)]
    assert len(pairs) == len(set(pairs)), "two children of one node carry the same token"


def reference_lookup(
    window: Sequence[int], min_match: int, max_match: int, max_occurrences: int, max_depth: int
) -> tuple[int, list[tuple[int, ...]]] | None:
    """Longest suffix of `window` occurring earlier with a token after it: (n, continuations)."""
    total = len(window)
    for n in range(min(max_match, total), min_match - 1, -1):
        tail = list(window[total - n :])
        ends = [e for e in range(total - 1, n - 1, -1) if list(window[e - n : e]) == tail]
        if ends:
            return n, [tuple(window[e : e + max_depth]) for e in ends[:max_occurrences]]
    return None


def check_proposal(
    proposal: SuffixProposal | None,
    root: int,
    expected: tuple[int, list[tuple[int, ...]]] | None,
    max_nodes: int,
    min_score: float,
) -> None:
    """The proposal is the best closed subtree of the trie of `expected`'s continuations."""
    if expected is None or max_nodes == 0 or not any(expected[1]):
        assert proposal is None
        return
    match_length, continuations = expected
    total = len(continuations)

    def score(path: tuple[int, ...]) -> float:
        return sum(c[: len(path)] == path for c in continuations) / total

    def newest(path: tuple[int, ...]) -> int:
        return next(rank for rank, c in enumerate(continuations) if c[: len(path)] == path)

    candidates = {c[:d] for c in continuations for d in range(1, len(c) + 1)}
    candidates = {p for p in candidates if score(p) >= min_score}
    if not candidates:
        assert proposal is None
        return
    assert proposal is not None
    assert proposal.match_length == match_length
    assert proposal.num_occurrences == total
    tree = proposal.tree
    assert tree.token_ids[0] == root
    assert len(proposal.scores) == tree.num_nodes
    assert proposal.scores[0] == 1.0
    assert_trie(tree)
    got = paths(tree)
    assert 1 <= tree.num_nodes - 1 <= max_nodes
    for path, s in zip(got[1:], proposal.scores[1:], strict=True):
        assert path in candidates, "not a continuation of an earlier occurrence"
        assert s == score(path)
    kept = set(got[1:])
    if len(candidates) <= max_nodes:
        assert kept == candidates
    else:
        assert len(kept) == max_nodes
        assert max(score(p) for p in candidates - kept) <= min(proposal.scores[1:])
    # Priority order: score, then depth, then recency.
    keys = [(-score(p), len(p), newest(p)) for p in got[1:]]
    assert keys == sorted(keys)


@st.composite
def index_case(draw):
    vocab = draw(st.integers(1, 5))
    stream = draw(st.lists(st.integers(0, vocab - 1), max_size=120))
    min_match = draw(st.integers(1, 3))
    max_match = draw(st.integers(min_match, 6))
    max_occurrences = draw(st.integers(1, 6))
    max_tokens = draw(st.integers(max_match, 150))
    cuts = sorted(draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    return stream, pieces, min_match, max_match, max_occurrences, max_tokens


def reference_index(
    stream: Sequence[int], max_tokens: int, min_match: int, max_match: int, keep: int
) -> dict[tuple[int, ...], list[int]]:
    """n-gram -> its `keep` most recent ends, over the n-grams wholly inside the last max_tokens."""
    base = max(0, len(stream) - max_tokens)
    index: dict[tuple[int, ...], list[int]] = {}
    for e in range(base + 1, len(stream) + 1):
        for n in range(min_match, max_match + 1):
            if e - n >= base:
                index.setdefault(tuple(stream[e - n : e]), []).append(e)
    return {key: ends[-keep:] for key, ends in index.items()}


@SETTINGS
@given(
    index_case(),
    st.integers(0, 6),
    st.integers(0, 20),
    st.sampled_from([0.0, 0.2, 0.5, 1.0]),
)
def test_index_matches_brute_force(case, max_depth, max_nodes, min_score):
    stream, pieces, min_match, max_match, max_occurrences, max_tokens = case
    index = SuffixIndex(min_match, max_match, max_occurrences, max_tokens)
    seen: list[int] = []
    for piece in pieces:
        index.extend(piece)
        seen += piece
        window = seen[-max_tokens:]
        assert len(index) == len(seen)
        assert index.retained == len(window)
        expected = reference_lookup(window, min_match, max_match, max_occurrences, max_depth)
        proposal = index.propose(max_depth, max_nodes, min_score)
        check_proposal(proposal, window[-1] if window else -1, expected, max_nodes, min_score)
    assert seen == stream
    # Bounds: the window's n-grams only, at most max_occurrences + 1 ends each (the tail's own end).
    inner = index._window
    assert inner.index == reference_index(seen, max_tokens, min_match, max_match, max_occurrences + 1)
    assert len(inner.tokens) <= 2 * max_tokens


@SETTINGS
@given(index_case(), st.integers(1, 6), st.integers(1, 20))
def test_extend_in_pieces_equals_extend_at_once(case, max_depth, max_nodes):
    stream, pieces, min_match, max_match, max_occurrences, max_tokens = case
    whole = SuffixIndex(min_match, max_match, max_occurrences, max_tokens)
    whole.extend(stream)
    split = SuffixIndex(min_match, max_match, max_occurrences, max_tokens)
    for piece in pieces:
        split.extend(piece)
    assert len(whole) == len(split) == len(stream)
    assert whole._window.index == split._window.index
    assert whole.propose(max_depth, max_nodes) == split.propose(max_depth, max_nodes)


def test_worked_example():
    index = SuffixIndex()
    index.extend([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3])
    proposal = index.propose(max_depth=2, max_nodes=8)
    assert proposal is not None
    assert proposal.match_length == 3 and proposal.num_occurrences == 2
    # Continuations, most recent first: [5, 1] and [4, 1]; equal scores, shallower first, then newer.
    assert paths(proposal.tree) == [(), (5,), (4,), (5, 1), (4, 1)]
    assert proposal.tree.token_ids[0] == 3
    assert proposal.scores == (1.0, 0.5, 0.5, 0.5, 0.5)
    assert index.propose(max_depth=2, max_nodes=8, min_score=0.6) is None
    index.extend([4])  # ... 1 2 3 4: occurred once, followed by 1 2 3 5
    proposal = index.propose(max_depth=3, max_nodes=8)
    assert proposal is not None and proposal.match_length == 4
    assert proposal.tree == TokenTree.chain([4, 1, 2, 3])


def test_no_match_and_empty():
    index = SuffixIndex(min_match=2)
    assert index.propose(4, 4) is None
    index.extend([1, 2, 3, 4])
    assert index.propose(4, 4) is None  # no bigram repeats
    index.extend([1, 2])
    assert index.propose(4, 4) is not None
    assert index.propose(0, 4) is None
    assert index.propose(4, 0) is None


def test_eviction_keeps_recent_window():
    index = SuffixIndex(max_match=4, max_tokens=10)
    index.extend([7, 8, 9] + [0] * 20)  # 7 8 9 leaves the window
    index.extend([7, 8])
    assert len(index) == 25 and index.retained == 10
    assert index.propose(4, 8) is None
    index.extend([7, 8])
    proposal = index.propose(4, 8)
    assert proposal is not None and proposal.match_length == 2 and proposal.tree.token_ids[1] == 7


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_match": 0},
        {"min_match": 3, "max_match": 2},
        {"max_occurrences": 0},
        {"max_match": 8, "max_tokens": 7},
    ],
)
def test_invalid_index_arguments(kwargs):
    with pytest.raises(InvalidArgument):
        SuffixIndex(**kwargs)


@pytest.mark.parametrize(("depth", "nodes", "min_score"), [(-1, 4, 0.0), (4, -1, 0.0), (4, 4, 1.5)])
def test_invalid_propose_arguments(depth, nodes, min_score):
    index = SuffixIndex()
    index.extend([1, 1, 1])
    with pytest.raises(InvalidArgument):
        index.propose(depth, nodes, min_score)
    with pytest.raises(InvalidArgument):
        SharedSuffixCache().propose("t", [1], depth, nodes, min_score)
    with pytest.raises(InvalidArgument):
        SharedSuffixCache(max_tenants=0)


def retained_outputs(outputs: Sequence[list[int]], bound: int) -> list[list[int]]:
    """The newest outputs that fit in `bound` tokens (an oversized newest one keeps its tail)."""
    kept: list[list[int]] = []
    size = 0
    for output in reversed(outputs):
        output = output[-bound:]
        if size + len(output) > bound:
            break
        kept.insert(0, output)
        size += len(output)
    return kept


def reference_shared(
    outputs: Sequence[Sequence[int]], context: Sequence[int], max_match: int, max_depth: int
) -> tuple[int, list[tuple[int, ...]]] | None:
    """Longest suffix of context found in one output with a token after it; continuations stay in
    that output, most recent (later output, later position) first."""
    for n in range(min(max_match, len(context)), 0, -1):
        tail = list(context[len(context) - n :])
        continuations = [
            tuple(output[e : e + max_depth])
            for output in reversed(outputs)
            for e in range(len(output) - 1, n - 1, -1)
            if list(output[e - n : e]) == tail
        ]
        if continuations:
            return n, continuations
    return None


@SETTINGS
@given(
    st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 3), max_size=12)), max_size=10),
    st.lists(st.integers(0, 13), max_size=10),
    st.integers(4, 40),
    st.integers(1, 5),
    st.integers(1, 12),
)
def test_shared_cache_matches_reference_and_isolates_tenants(adds, context, bound, max_depth, max_nodes):
    # Tenant "a" writes tokens 0..3, tenant "" writes 10..13: disjoint vocabularies.
    cache = SharedSuffixCache(max_tokens_per_tenant=bound, max_match=4, max_occurrences=1000)
    outputs: dict[str, list[list[int]]] = {"a": [], "": []}
    for to_a, output in adds:
        tenant = "a" if to_a else ""
        output = output if to_a else [t + 10 for t in output]
        cache.add(tenant, output)
        if output:
            outputs[tenant].append(output)
    for tenant, vocab in (("a", range(4)), ("", range(10, 14))):
        kept = retained_outputs(outputs[tenant], bound)
        assert cache.num_tokens(tenant) == sum(map(len, kept))
        proposal = cache.propose(tenant, context, max_depth, max_nodes)
        expected = reference_shared(kept, context, 4, max_depth)
        check_proposal(proposal, context[-1] if context else -1, expected, max_nodes, 0.0)
        if proposal is not None:
            assert all(t in vocab for t in proposal.tree.token_ids[1:])
            # Matched tail + path lies inside one stored output: no path crosses an output boundary.
            tail = list(context[-proposal.match_length :])
            for path in paths(proposal.tree)[1:]:
                needle = tail + list(path)
                assert any(
                    output[i : i + len(needle)] == needle
                    for output in kept
                    for i in range(len(output) - len(needle) + 1)
                )


def test_shared_cache_boundaries_and_eviction():
    cache = SharedSuffixCache(max_tokens_per_tenant=8, max_match=4)
    cache.add("t", [1, 2, 3])
    cache.add("t", [4, 5])
    proposal = cache.propose("t", [9, 2], 4, 8)
    assert proposal is not None and paths(proposal.tree) == [(), (3,)]  # stops at the output's end
    assert cache.propose("t", [3], 4, 8) is None  # 3 ends its output: nothing follows it there
    proposal = cache.propose("t", [2, 3, 4], 4, 8)  # 2 3 4 and 3 4 span two outputs: 4 alone matches
    assert proposal is not None and proposal.match_length == 1 and paths(proposal.tree) == [(), (5,)]
    cache.add("t", [6, 7, 8, 9])  # 9 tokens: the oldest output goes whole
    assert cache.num_tokens("t") == 6
    assert cache.propose("t", [1], 4, 8) is None
    assert cache.propose("u", [4], 4, 8) is None  # another tenant sees nothing
    cache.add("t", list(range(20, 40)))  # longer than the bound: its last 8 tokens stay
    assert cache.num_tokens("t") == 8
    proposal = cache.propose("t", [33], 4, 8)
    assert proposal is not None and proposal.tree == TokenTree.chain([33, 34, 35, 36, 37])


def test_shared_cache_least_recently_used_tenant_goes():
    cache = SharedSuffixCache(max_tenants=2)
    cache.add("a", [1, 2])
    cache.add("b", [1, 2])
    assert cache.propose("a", [1], 2, 2) is not None  # "a" is now the more recent
    cache.add("c", [1, 2])
    assert len(cache) == 2
    assert cache.num_tokens("b") == 0
    assert cache.propose("a", [1], 2, 2) is not None
    assert cache.propose("c", [1], 2, 2) is not None


def test_shared_cache_is_thread_safe():
    cache = SharedSuffixCache(max_tenants=3, max_tokens_per_tenant=200)

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(300):
            tenant = str(rng.randrange(5))
            if rng.random() < 0.5:
                cache.add(tenant, [rng.randrange(6) for _ in range(rng.randrange(30))])
            else:
                proposal = cache.propose(tenant, [rng.randrange(6) for _ in range(5)], 4, 8)
                if proposal is not None:
                    assert proposal.tree.num_nodes <= 9

    assert not errors_in_threads(work)
    assert len(cache) <= 3
    assert all(cache.num_tokens(str(t)) <= 200 for t in range(5))


@st.composite
def random_tree(draw, root: int, monotone: bool):
    """Any tree over tokens 0..3 (siblings may repeat a token), with scores."""
    size = draw(st.integers(1, 12))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, size)]
    tokens = [root] + [draw(st.integers(0, 3)) for _ in range(1, size)]
    scores = [1.0]
    for i in range(1, size):
        factor = draw(st.floats(0.0, 1.0))
        scores.append(scores[parents[i]] * factor if monotone else factor)
    return TokenTree(tuple(tokens), tuple(parents)), scores


@SETTINGS
@given(st.data(), st.booleans(), st.integers(0, 30))
def test_merge_proposals(data, monotone, max_nodes):
    root = 9
    proposals = data.draw(st.lists(random_tree(root, monotone), max_size=4))
    best: dict[tuple[int, ...], float] = {}
    first: dict[tuple[int, ...], int] = {}
    for source, (tree, scores) in enumerate(proposals):
        for path, score in zip(paths(tree)[1:], scores[1:], strict=True):
            best[path] = max(best.get(path, score), score)
            first.setdefault(path, source)
    tree, scores, sources = merge_proposals(root, proposals, max_nodes)
    assert tree.token_ids[0] == root and scores[0] == 1.0 and sources[0] == -1
    assert len(scores) == len(sources) == tree.num_nodes <= max_nodes + 1
    assert_trie(tree)  # TokenTree itself checks that parents come first
    got = paths(tree)
    assert len(set(got)) == len(got)
    for path, score, source in zip(got[1:], scores[1:], sources[1:], strict=True):
        assert score == best[path] and source == first[path]
    if len(best) <= max_nodes:
        assert set(got[1:]) == set(best)
    else:
        assert tree.num_nodes == max_nodes + 1
        if monotone:
            assert max(best[p] for p in set(best) - set(got)) <= min(scores[1:], default=1.0)
    if monotone:
        assert list(scores[1:]) == sorted(scores[1:], reverse=True)


def test_merge_proposals_worked_example():
    suffix = (TokenTree((5, 1, 2), (-1, 0, 1)), [1.0, 0.5, 0.5])
    draft = (TokenTree((5, 1, 3, 4), (-1, 0, 1, 0)), [1.0, 0.9, 0.6, 0.2])
    tree, scores, sources = merge_proposals(5, [suffix, draft], max_nodes=3)
    assert paths(tree) == [(), (1,), (1, 3), (1, 2)]
    assert scores == (1.0, 0.9, 0.6, 0.5)
    assert sources == (-1, 0, 1, 0)
    assert tree_depths(tree.parent_ids) == [0, 1, 2, 2]
    with pytest.raises(InvalidArgument):
        merge_proposals(6, [suffix], 3)
    with pytest.raises(InvalidArgument):
        merge_proposals(5, [(suffix[0], [1.0])], 3)


def test_speed_is_not_quadratic():
    rng = random.Random(0)
    stream = [rng.randrange(50) for _ in range(100_000)]
    index = SuffixIndex()
    started = time.perf_counter()
    proposed = 0
    for i in range(0, len(stream), 100):
        index.extend(stream[i : i + 100])
        proposal = index.propose(max_depth=8, max_nodes=32)
        proposed += proposal is not None
    assert time.perf_counter() - started < 20.0
    assert proposed >= 990  # the first rounds may find no earlier occurrence
