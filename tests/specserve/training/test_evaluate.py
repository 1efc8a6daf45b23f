"""eval-draft: lags under the block mask, agreement counting, the chain estimate, a teacher-forced run."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve.training.evaluate import (
    Agreement,
    count_agreement,
    evaluate_draft,
    held_out_answers,
    lag_of_positions,
)
from specserve.training.features import IGNORE
from specserve.training.settings import TrainSettings
from specserve.training.trainer import new_draft


def test_lags_follow_the_block_mask() -> None:
    # block 3: the first block sees itself (lag 0); then a query at 3b + i sees positions < 3b
    assert lag_of_positions(9, 3).tolist() == [0, 0, 0, 1, 2, 3, 1, 2, 3]


def test_count_agreement_by_lag() -> None:
    labels = torch.tensor([[5, 5, 7, 8, 9, IGNORE]])  # block 2: lags 0 0 1 2 1 2
    predicted = torch.tensor([[5, 6, 7, 0, 9, 9]])
    result = count_agreement(predicted, labels, block_size=2)
    # lag 0 is never scored; lag 1 = positions 2, 4 (both agree); lag 2 = position 3 (no), 5 (ignored)
    assert result.agreed == (2, 0)
    assert result.scored == (2, 1)
    assert result.by_lag == [1.0, 0.0]
    assert result.overall == pytest.approx(2 / 3)


def test_chain_accepted_multiplies_the_lags() -> None:
    result = Agreement(agreed=(8, 5, 1), scored=(10, 10, 10))  # 0.8, 0.5, 0.1
    assert result.chain_accepted(1) == pytest.approx(0.8)
    assert result.chain_accepted(3) == pytest.approx(0.8 + 0.4 + 0.04)
    with pytest.raises(ValueError):
        result.chain_accepted(4)
    assert json.loads(json.dumps(result.to_json()))["by_lag"] == pytest.approx([0.8, 0.5, 0.1])


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()


def test_evaluate_scores_answer_positions_only(tmp_path, target) -> None:
    settings = TrainSettings(data_dir=tmp_path, out_dir=tmp_path, model_dir=tmp_path, draft_vocab_size=None)
    draft = new_draft(settings, target, target_layer=-1).eval()
    sequences = [list(range(100, 130)), list(range(200, 220))]
    starts = [12, 3]
    result = evaluate_draft(target, draft, sequences, starts, pad_id=0, batch_size=2, progress=False)
    block = draft.config.block_size
    expected = sum(len(range(max(s, block), len(seq))) for seq, s in zip(sequences, starts, strict=True))
    assert sum(result.scored) == expected  # every answer position after the first block, no padding
    assert 0.0 <= result.overall <= 1.0


def test_answers_are_cached_and_keyed(tmp_path, target, tiny_target_dir) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    cache = tmp_path / "answers.json"
    first = held_out_answers(target, tokenizer, ["Say hi.", "Count to three."], 4, cache, batch_size=2)
    assert cache.is_file()
    sequences, starts = first
    assert all(len(seq) > start for seq, start in zip(sequences, starts, strict=True))
    # a cached file is reused only for the same prompts and length
    record = json.loads(cache.read_text())
    record["sequences"][0] = [1, 2, 3]
    cache.write_text(json.dumps(record))
    assert held_out_answers(target, tokenizer, ["Say hi.", "Count to three."], 4, cache)[0][0] == [1, 2, 3]
    assert held_out_answers(target, tokenizer, ["Say hi."], 4, cache)[0][0] != [1, 2, 3]
