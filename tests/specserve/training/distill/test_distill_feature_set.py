"""The training set in memory: a fraction of the sequences is a seeded subset of any larger fraction, each
epoch visits every sequence once, and a batch pads on the right and scores only the answer's predictions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specserve.training.distill.feature_set import FeatureSet, batch_indices

HEADS, HEAD_DIM, TOP_K = 2, 4, 3


def write_shard(path: Path, first_id: int, lengths: list[int], prompt_length: int = 2) -> None:
    """A feature file as extraction writes it, of made-up values: sequence i's tokens are all
    first_id + i, its K/V of layer 0 the same number, so a loaded row tells which sequence it is."""
    tokens = np.concatenate([np.full(n, first_id + i, dtype=np.uint16) for i, n in enumerate(lengths)])
    kv = np.broadcast_to(tokens[:, None, None], (len(tokens), HEADS, HEAD_DIM)).astype(np.float16)
    np.savez(
        path,
        tokens=tokens,
        lengths=np.asarray(lengths, dtype=np.int32),
        prompt_lengths=np.full(len(lengths), prompt_length, dtype=np.int32),
        topk_ids=np.broadcast_to(tokens[:, None], (len(tokens), TOP_K)).astype(np.uint16),
        topk_probs=np.full((len(tokens), TOP_K), 0.25, dtype=np.float16),
        **{"k.0": kv, "v.0": -kv},
    )


def sequence_ids(data: FeatureSet) -> set[int]:
    return {int(data.tokens[start]) for start in data.starts}


def test_a_smaller_fraction_is_a_seeded_subset_of_a_larger_one(tmp_path: Path) -> None:
    write_shard(tmp_path / "answers-shard-00000.npz", 100, [3 + i % 4 for i in range(10)])
    write_shard(tmp_path / "instruct-shard-00000.npz", 200, [5, 6, 7, 8, 9, 10])
    whole = FeatureSet.load(tmp_path)
    assert len(whole) == 16 and sequence_ids(whole) == {*range(100, 110), *range(200, 206)}
    quarter, half = FeatureSet.load(tmp_path, fraction=0.25), FeatureSet.load(tmp_path, fraction=0.5)
    assert (len(quarter), len(half)) == (4, 8)
    assert sequence_ids(quarter) < sequence_ids(half) < sequence_ids(whole)
    assert sequence_ids(FeatureSet.load(tmp_path, fraction=0.25)) == sequence_ids(quarter)
    # each kept sequence still reads its own tokens and length
    for start, length in zip(quarter.starts, quarter.lengths, strict=True):
        assert len(set(quarter.tokens[start : start + length].tolist())) == 1
    assert quarter.answer_tokens == int((quarter.lengths - 2).sum())


def test_each_epoch_visits_every_sequence_once_and_a_step_names_its_batch() -> None:
    epoch = [batch_indices(10, 3, step, seed=0) for step in range(3)]  # 3 full batches an epoch
    visited = [i for batch in epoch for i in batch]
    assert len(visited) == len(set(visited)) == 9 and all(len(batch) == 3 for batch in epoch)
    assert batch_indices(10, 3, 1, seed=0) == epoch[1]  # a resumed run gets the same batch
    assert batch_indices(10, 3, 3, seed=0) != epoch[0]  # the next epoch is shuffled anew
    assert [batch_indices(10, 3, step, seed=1) for step in range(3)] != epoch


def test_a_batch_pads_on_the_right_and_scores_only_the_answers_predictions(tmp_path: Path) -> None:
    write_shard(tmp_path / "answers-shard-00000.npz", 100, [4, 7], prompt_length=3)
    data = FeatureSet.load(tmp_path)
    batch = data.batch([0, 1], block_layers=[0, 0])
    assert batch["input_ids"].tolist() == [[100] * 4 + [0] * 3, [101] * 7]
    # one prediction per answer token: from the last prompt position to the one before the end
    answers = [[False] * 2 + [True] + [False] * 4, [False] * 2 + [True] * 4 + [False]]
    assert batch["loss_mask"].tolist() == answers
    assert batch["target_k.0"].shape == (2, HEADS, 7, HEAD_DIM)  # [B, Hkv, S, D], as a draft block reads
    assert torch.equal(batch["target_v.1"][1], -batch["target_k.0"][1])
    assert float(batch["target_k.0"][0, :, 4:].abs().sum()) == 0  # padding
    assert batch["topk_ids"].shape == (2, 7, TOP_K) and "hidden" not in batch
