"""Target features for training: K/V and labels match a plain unpadded forward and the distillation
shards; packing."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from specserve.training.distill.feature_extraction import sequence_features
from specserve.training.features import IGNORE, pack_tokens, pad_rows, target_features, teacher_forced


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
    """`target_features` and `distill.feature_extraction.sequence_features` shape one teacher-forced pass:
    a sequence's K/V are the same bits in both, and both name the same next token."""
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


def test_layer_outputs_are_each_decoder_layers_residual_stream_before_any_norm(tiny_target_dir) -> None:
    """A fused draft's input: decoder layer i's output is the input of layer i + 1, which transformers
    reports as hidden_states[i + 1]; the shards hold exactly those values (fp16), padding aside."""
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    rows = [list(range(5, 17)), list(range(40, 47))]
    passed = teacher_forced(model, pad_rows(rows, 12, pad_id=0), [], output_layers=[0])
    with torch.inference_mode():
        reference = model.model(pad_rows(rows, 12, pad_id=0), output_hidden_states=True).hidden_states
    assert set(passed.layer_outputs) == {0}
    assert torch.allclose(passed.layer_outputs[0], reference[1], atol=1e-6)
    # the last layer's output is not the normed state the head reads
    last = model.config.num_hidden_layers - 1
    deepest = teacher_forced(model, pad_rows(rows, 12, pad_id=0), [], output_layers=[last])
    assert not torch.allclose(deepest.layer_outputs[last], deepest.hidden, atol=1e-3)
    shards = sequence_features(model, rows, layers=[-1], top_k=4, output_layers=[0])
    for row, (tokens, shard) in enumerate(zip(rows, shards, strict=True)):
        n = len(tokens)
        expected = reference[1][row, :n].half().numpy()
        assert shard["h.0"].shape == expected.shape and (shard["h.0"] == expected).all()
