"""Target features for training: K/V and labels match a plain unpadded forward and the distillation
shards; packing."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from specserve.training.features import IGNORE, pack_tokens, pad_rows, target_features


def test_features_equal_an_unpadded_forward(tiny_target_dir) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    rows = [list(range(5, 17)), list(range(40, 47))]  # lengths 12 and 7
    batch = pad_rows(rows, 12, pad_id=0)
    features = target_features(model, batch, [12, 7], layer=-1)
    short = torch.tensor([rows[1]])
    with torch.no_grad():
        alone = model(input_ids=short, use_cache=True)
    layer = alone.past_key_values.layers[-1]
    torch.testing.assert_close(features["target_k"][1, :, :7].float(), layer.keys[0], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(features["target_v"][1, :, :7].float(), layer.values[0], atol=2e-3, rtol=2e-3)
    assert features["labels"][1, :7].tolist() == alone.logits[0].argmax(-1).tolist()
    assert features["labels"][1, 7:].tolist() == [IGNORE] * 5
    assert features["target_k"].dtype == torch.float16


def test_features_read_the_chosen_layer(tiny_target_dir) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    batch = pad_rows([list(range(3, 11))], 8, pad_id=0)
    first = target_features(model, batch, [8], layer=0)["target_k"]
    last = target_features(model, batch, [8], layer=-1)["target_k"]
    assert not torch.equal(first, last)


def test_training_batches_and_distillation_shards_hold_the_same_target_values(tiny_target_dir) -> None:
    """`target_features` and `distill.sequence_features` shape one teacher-forced pass: a sequence's K/V
    are the same bits in both, and both name the same next token."""
    from specserve.training.distill import sequence_features

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    rows = [list(range(5, 17)), list(range(40, 47))]  # lengths 12 and 7
    batch = target_features(model, pad_rows(rows, 12, pad_id=0), [12, 7], layer=-1, extra_layers=(0,))
    shards = sequence_features(model, rows, layers=[-1, 0], top_k=4)
    last = model.config.num_hidden_layers - 1
    for row, (tokens, shard) in enumerate(zip(rows, shards, strict=True)):
        n = len(tokens)
        for layer, k, v in ((last, "target_k", "target_v"), (0, "target_k.0", "target_v.0")):
            # [Hkv, L, D] in a training batch, [L, Hkv, D] in a shard
            assert torch.equal(batch[k][row, :, :n].transpose(0, 1), torch.from_numpy(shard[f"k.{layer}"]))
            assert torch.equal(batch[v][row, :, :n].transpose(0, 1), torch.from_numpy(shard[f"v.{layer}"]))
        assert batch["labels"][row, :n].tolist() == shard["topk_ids"][:, 0].tolist()


def test_pack_tokens_cuts_the_stream_and_drops_a_short_tail() -> None:
    docs = [[1] * 10, [2] * 10, [3] * 5]
    assert pack_tokens(docs, 8, min_length=4) == [[1] * 8, [1, 1] + [2] * 6, [2] * 4 + [3] * 4]
    assert pack_tokens(docs, 8, min_length=1)[-1] == [3]
