"""Regression tests for request checks that live outside the message: each case is an input a tester
sent to the services and that got through (or came back INTERNAL) before these checks existed."""

from __future__ import annotations

import math

import pytest

from specserve.errors import (
    MAX_MESSAGE_CHARS,
    MAX_QUOTED_CHARS,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    bounded,
    quoted,
)
from specserve.serving.convert import check_session_id, sampling_from_pb, tree_from_pb
from specserve.serving.validate import (
    check_prompt_chars,
    check_rebuild,
    check_target_address,
    check_token_ids,
)
from specserve.v1 import common_pb2

VOCAB = 100


@pytest.mark.parametrize("session_id", ["abc\n", "abc\r\n", "\nabc", "a b", "", "x" * 65, "é"])
def test_session_ids_outside_the_pattern_are_refused(session_id: str) -> None:
    with pytest.raises(InvalidArgument):
        check_session_id(session_id)


def test_a_huge_session_id_is_quoted_short() -> None:
    with pytest.raises(InvalidArgument) as raised:
        check_session_id("s" * 1_000_000)
    assert len(str(raised.value)) < 200 and "(1000000 characters)" in str(raised.value)


def test_session_ids_inside_the_pattern_pass() -> None:
    assert check_session_id("a-Z_9" * 12) == "a-Z_9" * 12


@pytest.mark.parametrize("temperature", [math.inf, -math.inf, math.nan, -0.5, 1e30])
def test_temperature_must_be_finite_and_bounded(temperature: float) -> None:
    with pytest.raises(InvalidArgument, match="temperature"):
        sampling_from_pb(common_pb2.SamplingParams(temperature=temperature))


@pytest.mark.parametrize("top_p", [math.inf, math.nan, -1.0])
def test_top_p_must_be_finite(top_p: float) -> None:
    with pytest.raises(InvalidArgument, match="top_p"):
        sampling_from_pb(common_pb2.SamplingParams(temperature=1.0, top_p=top_p))


def test_a_prompt_too_long_for_any_tokenization_is_refused_by_length() -> None:
    check_prompt_chars("x" * 1000, max_prompt_tokens=100, max_token_chars=10)
    with pytest.raises(InvalidArgument, match="characters"):
        check_prompt_chars("x" * 1001, max_prompt_tokens=100, max_token_chars=10)


def sampled_tree(token_ids: list[int], probs: list[float], extra: list | None = None) -> common_pb2.DraftTree:
    q = common_pb2.SparseProbs(node=0, token_ids=token_ids, probs=probs)
    return common_pb2.DraftTree(
        token_ids=[5, 7],
        parent_ids=[-1, 0],
        kind=common_pb2.CANDIDATE_KIND_SAMPLED,
        draft_probs=[q, *(extra or [])],
    )


@pytest.mark.parametrize(
    ("token_ids", "probs"),
    [
        pytest.param([7, 8], [1.0], id="length-mismatch"),
        pytest.param([7], [math.nan], id="nan"),
        pytest.param([7, 8], [-0.5, 1.0], id="negative"),
        pytest.param([7], [1e30], id="huge"),
        pytest.param([7, 8], [0.7, 0.7], id="sum-above-one"),
        pytest.param([7, 7], [0.5, 0.5], id="repeated-token"),
        pytest.param([7], [math.inf], id="inf"),
    ],
)
def test_malformed_draft_probabilities_are_refused(token_ids: list[int], probs: list[float]) -> None:
    with pytest.raises(InvalidArgument, match="draft_probs"):
        tree_from_pb(sampled_tree(token_ids, probs), max_nodes=8)


def test_two_distributions_for_one_node_are_refused() -> None:
    twice = common_pb2.SparseProbs(node=0, token_ids=[7], probs=[1.0])
    with pytest.raises(InvalidArgument, match="two entries"):
        tree_from_pb(sampled_tree([7], [1.0], [twice]), max_nodes=8)


def test_a_valid_distribution_passes_and_stays_in_the_message() -> None:
    draft = tree_from_pb(sampled_tree([7, 8], [0.25, 0.75]), max_nodes=8)
    assert draft.tree.token_ids == (5, 7) and not draft.draft_probs  # tensors are made at the target


@pytest.mark.parametrize("root", [-5, -1, VOCAB, 2**31 - 1])
def test_a_rebuild_root_outside_the_vocabulary_is_refused(root: int) -> None:
    with pytest.raises(InvalidArgument, match="root_token"):
        check_rebuild([1, 2, 3], root, VOCAB, held=None)


def test_a_rebuild_that_disagrees_with_the_held_history_is_refused() -> None:
    held = [1, 2, 3, 4, 5]
    check_rebuild([1, 2, 3], 4, VOCAB, held)  # behind the target: a prefix
    check_rebuild([1, 2, 3, 4, 5, 6], 7, VOCAB, held)  # ahead of it
    with pytest.raises(FailedPrecondition):
        check_rebuild([1, 2, 9], 4, VOCAB, held)  # same length, other tokens: another session's output
    with pytest.raises(FailedPrecondition):
        check_rebuild([1, 2, 3, 4], 6, VOCAB, held)


def test_token_ids_outside_the_vocabulary_are_refused() -> None:
    check_token_ids([0, VOCAB - 1], VOCAB)
    for bad in ([-1], [VOCAB], [1, 2**31 - 1]):
        with pytest.raises(InvalidArgument):
            check_token_ids(bad, VOCAB)


def test_the_draft_dials_only_configured_targets() -> None:
    check_target_address("target:50051", ("target:50051",))
    with pytest.raises(PermissionDenied):
        check_target_address("evil.example:443", ("target:50051",))


def test_a_dns_entry_allows_every_address_it_resolves_to() -> None:
    allowed = ("dns:///localhost:50051",)
    check_target_address("127.0.0.1:50051", allowed)
    for address in ("127.0.0.1:50052", "10.0.0.1:50051", "localhost:50051"):
        with pytest.raises(PermissionDenied):
            check_target_address(address, allowed)


def test_quoted_values_and_whole_messages_are_bounded() -> None:
    assert quoted("short") == "'short'"
    huge = quoted("v" * 1_000_000)
    assert huge.startswith("'vvv") and huge.endswith("... (1000000 characters)")
    assert len(huge) <= MAX_QUOTED_CHARS + 30
    assert quoted(["x"] * 1000).endswith("characters)")
    message = "unknown method '" + "m" * 1_000_000 + "'; known methods: target, glide"
    cut = bounded(message)
    assert len(cut) <= MAX_MESSAGE_CHARS
    assert cut.startswith("unknown method 'mmm") and cut.endswith("known methods: target, glide")
    assert bounded("fine as it is") == "fine as it is"
