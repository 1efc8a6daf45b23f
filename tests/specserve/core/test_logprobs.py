"""Token log-probabilities from hand-built logits with obvious values."""

from __future__ import annotations

import math

import pytest
import torch

from specserve.core.logprobs import path_logprobs, token_logprobs
from specserve.serving.convert import logprobs_to_pb


def test_log_softmax_of_raw_logits_and_top_tokens() -> None:
    logits = torch.tensor([[0.0, math.log(3.0), 0.0, 0.0]])  # probs 1/6, 1/2, 1/6, 1/6
    [scored] = token_logprobs(logits, [0], [2], num_top=2)
    assert scored.token_id == 2
    assert scored.logprob == pytest.approx(math.log(1 / 6), abs=1e-6)
    assert scored.top[0] == (1, pytest.approx(math.log(0.5), abs=1e-6))
    assert len(scored.top) == 2


def test_path_scores_each_token_on_its_parents_row() -> None:
    # Tree: root 0 -> node 1 (token 5), node 2 (token 6); node 1 -> node 3 (token 7). Path [0, 1, 3].
    vocab = 10
    logits = torch.full((4, vocab), -5.0)
    logits[0, 5] = 5.0  # the root's row predicts node 1's token
    logits[1, 7] = 4.0  # node 1's row predicts node 3's token
    logits[3, 9] = 3.0  # node 3's row predicts the bonus token
    scored = path_logprobs(logits, [0, 1, 3], [100, 5, 6, 7], next_token=9, num_top=1)
    assert [s.token_id for s in scored] == [5, 7, 9]
    expected = torch.log_softmax(logits, -1)
    assert [s.logprob for s in scored] == pytest.approx(
        [expected[0, 5].item(), expected[1, 7].item(), expected[3, 9].item()], abs=1e-6
    )
    assert [s.top[0][0] for s in scored] == [5, 7, 9]


def test_root_only_round_scores_the_next_token_alone() -> None:
    logits = torch.zeros(1, 4)
    [scored] = path_logprobs(logits, [0], [3], next_token=1)
    assert scored.token_id == 1 and scored.top == ()
    assert scored.logprob == pytest.approx(math.log(0.25), abs=1e-6)


def test_rejects_mismatched_rows_and_too_many_top_tokens() -> None:
    with pytest.raises(ValueError, match="rows"):
        token_logprobs(torch.zeros(2, 4), [0, 1], [1])
    with pytest.raises(ValueError, match="num_top"):
        token_logprobs(torch.zeros(1, 4), [0], [1], num_top=21)


def test_wire_form_keeps_every_value() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    [scored] = token_logprobs(logits, [0], [1], num_top=2)
    [wire] = logprobs_to_pb([scored])
    assert wire.token_id == 1 and wire.logprob == pytest.approx(scored.logprob)
    assert list(wire.top_token_ids) == [3, 2]
    assert list(wire.top_logprobs) == pytest.approx([v for _, v in scored.top])
