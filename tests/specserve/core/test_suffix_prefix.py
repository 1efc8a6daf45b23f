"""A suffix index started from a shared IndexedPrefix proposes exactly what one that indexed its whole
stream proposes, whatever the spans, where the prefix is cut, and past the first eviction."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve.core.suffix import IndexedPrefix, SuffixIndex
from specserve.errors import InvalidArgument

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ASKS = ((1, 1), (3, 5), (6, 20))  # (max_depth, max_nodes)


@st.composite
def shared_case(draw):
    vocab = draw(st.integers(1, 4))
    stream = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=120))
    min_match = draw(st.integers(1, 3))
    max_match = draw(st.integers(min_match, 6))
    max_occurrences = draw(st.integers(1, 5))
    max_tokens = draw(st.integers(max(max_match, 1), 160))
    prompt = draw(st.integers(1, len(stream)))
    # Span ends of the cached prompt (which may run past this stream's prompt: then it is cut).
    ends = sorted(set(draw(st.lists(st.integers(1, len(stream)), min_size=1, max_size=5))))
    cut = draw(st.integers(0, min(prompt, ends[-1])))
    pieces = sorted(draw(st.lists(st.integers(prompt, len(stream)), max_size=6)))
    return stream, min_match, max_match, max_occurrences, max_tokens, prompt, ends, cut, pieces


def spans(stream: list[int], ends: list[int], min_match: int, max_match: int) -> IndexedPrefix:
    prefix = IndexedPrefix.empty(min_match, max_match)
    for end in ends:
        prefix = prefix.extended(stream, end)
    return prefix


@SETTINGS
@given(shared_case())
def test_an_index_from_a_shared_prefix_proposes_as_one_built_alone(case):
    stream, min_match, max_match, max_occurrences, max_tokens, prompt, ends, cut, pieces = case
    prefix = spans(stream, ends, min_match, max_match).cut(cut)
    assert prefix.length == cut and prefix.matches(stream)
    alone = SuffixIndex(min_match, max_match, max_occurrences, max_tokens)
    shared = SuffixIndex(min_match, max_match, max_occurrences, max_tokens)
    alone.extend(stream[:prompt])
    shared.extend_from(prefix, stream[:prompt])
    for a, b in zip([prompt, *pieces], [*pieces, len(stream)], strict=True):
        if a < b:
            alone.extend(stream[a:b])
            shared.extend(stream[a:b])
        assert len(alone) == len(shared) == b
        assert alone.retained == shared.retained
        for depth, nodes in ASKS:
            assert shared.propose(depth, nodes) == alone.propose(depth, nodes)


def test_a_shared_prefix_is_read_not_rebuilt_and_left_on_eviction():
    stream = [1, 2, 3, 1, 2, 4, 1, 2] * 4  # [32]
    prefix = spans(stream, [16, 24], 1, 4)
    index = SuffixIndex(max_match=4, max_occurrences=4, max_tokens=40)
    index.extend_from(prefix, stream[:28])
    assert index.shared_tokens == 24 and len(index._window.index) > 0
    assert all(end > 24 for ends in index._window.index.values() for end in ends)  # its own n-grams only
    index.extend(stream[28:])
    assert index.shared_tokens == 24
    index.extend([9] * 10)  # past max_tokens: the window is indexed here, and evicts
    assert index.shared_tokens == 0 and index.retained == 40 and len(index) == 42


def test_a_prefix_cut_inside_a_span_reads_it_only_up_to_the_cut():
    cached = [5, 6, 7, 5, 6, 8, 8, 8]
    prefix = spans(cached, [8], 1, 3).cut(4)  # [5, 6, 7, 5]: the span is read up to position 4
    ours = [5, 6, 7, 5, 6]
    index = SuffixIndex(max_match=3, max_occurrences=4, max_tokens=64)
    index.extend_from(prefix, ours)
    proposal = index.propose(4, 8)
    assert proposal is not None and proposal.match_length == 2
    # After "5 6" came "7 5 6" in this stream; the cached stream's "8 8 8" is not ours.
    assert 8 not in proposal.tree.token_ids and proposal.tree.token_ids[1:] == (7, 5, 6)


def test_shared_prefix_errors():
    stream = [1, 2, 3, 4, 1, 2]
    prefix = spans(stream, [4], 1, 4)
    index = SuffixIndex(max_match=4)
    index.extend([1])
    with pytest.raises(InvalidArgument, match="empty"):
        index.extend_from(prefix, stream)
    with pytest.raises(InvalidArgument, match="match lengths"):
        SuffixIndex(max_match=3).extend_from(prefix, stream)
    with pytest.raises(InvalidArgument, match="not a prefix"):
        SuffixIndex(max_match=4).extend_from(prefix, [1, 2, 9, 4, 1])
    with pytest.raises(InvalidArgument):
        prefix.extended(stream, 4)  # a span must end after the prefix
    with pytest.raises(InvalidArgument):
        prefix.cut(5)
    assert not prefix.matches([1, 2, 3])


@pytest.mark.parametrize("max_match", [1, 2, 4])
def test_every_span_boundary_keeps_the_n_grams_across_it(max_match):
    """n-grams that cross a span's start (up to max_match - 1 tokens before it) are found, at every
    boundary, with the prefix cut at every point."""
    stream = [0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 1, 0, 1, 2, 3]
    for boundary in range(1, len(stream)):
        for cut in range(boundary, len(stream) + 1):
            prefix = spans(stream, [boundary, len(stream)], 1, max_match).cut(cut)
            for prompt in range(cut, len(stream) + 1):
                alone = SuffixIndex(1, max_match, 3, 64)
                shared = SuffixIndex(1, max_match, 3, 64)
                alone.extend(stream[:prompt])
                shared.extend_from(prefix, stream[:prompt])
                for depth, nodes in ASKS:
                    assert shared.propose(depth, nodes) == alone.propose(depth, nodes), (
                        boundary,
                        cut,
                        prompt,
                    )
