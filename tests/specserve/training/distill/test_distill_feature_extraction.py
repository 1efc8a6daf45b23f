"""Distillation features: each generated row's tokens, the target's top-k, the K/V of every asked layer
and the hidden state its LM head reads, as an unpadded forward gives them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.training.distill.feature_extraction import extract_features
from specserve.training.distill.feature_set import FeatureSet
from specserve.training.generation import ANSWERS, read_stage


def test_features_hold_the_targets_top_k_of_each_generated_row(tiny, generated, features) -> None:
    model, _ = tiny
    data = FeatureSet.load(features)
    rows = read_stage(generated / ANSWERS).sequences()
    assert len(data) == len(rows)
    for i in (0, len(rows) - 1):
        prompt, answer = rows[i]
        start, length = int(data.starts[i]), int(data.lengths[i])
        assert data.tokens[start : start + length].tolist() == prompt + answer
        assert int(data.prompt_lengths[i]) == len(prompt)
        with torch.no_grad():
            probs = torch.softmax(model(torch.tensor([prompt + answer])).logits[0], -1)  # [L, V]
        top = probs.topk(4, dim=-1)
        np.testing.assert_array_equal(data.topk_ids[start : start + length], top.indices.numpy())
        np.testing.assert_allclose(data.topk_probs[start : start + length], top.values.numpy(), atol=1e-3)
    batch = data.batch([0, 1], list(data.kv))
    assert batch["loss_mask"][0].sum() == len(rows[0][1])  # one prediction per answer token


def test_features_keep_each_asked_layer_and_blocks_get_theirs(tiny, generated, tmp_path) -> None:
    model, _ = tiny
    extract_features(model, generated, tmp_path / "features", layers=(-1, 0), top_k=4, log=lambda _: None)
    data = FeatureSet.load(tmp_path / "features")
    last = model.config.num_hidden_layers - 1
    assert sorted(data.kv) == [0, last]  # numbered from 0 whatever the caller wrote
    prompt, answer = read_stage(generated / ANSWERS).sequences()[0]
    with torch.no_grad():
        cache = model(torch.tensor([prompt + answer]), use_cache=True).past_key_values
    length = int(data.lengths[0])
    for layer in (0, last):
        expected = cache.layers[layer].keys[0].transpose(0, 1)  # [L, Hkv, D]
        np.testing.assert_allclose(data.kv[layer][0][:length], expected.numpy(), atol=2e-3, rtol=2e-3)
    batch = data.batch([0], [0, last])  # block 0 reads layer 0, block 1 the last
    for block, layer in enumerate((0, last)):
        stored = torch.from_numpy(data.kv[layer][1][:length]).transpose(0, 1)  # [Hkv, L, D]
        assert torch.equal(batch[f"target_v.{block}"][0, :, :length], stored)
    only_first = FeatureSet.load(tmp_path / "features", layers=[0])
    assert list(only_first.kv) == [0]
    with pytest.raises(FileNotFoundError):
        FeatureSet.load(tmp_path / "features", layers=[1, 5])


def test_stored_hidden_state_is_the_normed_vector_the_lm_head_reads(tiny, generated, features) -> None:
    model, _ = tiny
    data = FeatureSet.load(features, layers=[], hidden=True)
    prompt, answer = read_stage(generated / ANSWERS).sequences()[0]
    ids = torch.tensor([prompt + answer])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        last_layer = out.hidden_states[-1][0]  # transformers: after the final norm
        # by hand: the last decoder layer's output, normed with the final RMSNorm
        pre = model.model.layers[-1](
            out.hidden_states[-2],
            position_embeddings=model.model.rotary_emb(
                out.hidden_states[-2], torch.arange(ids.shape[1])[None]
            ),
            attention_mask=None,
        )
        pre = pre[0] if isinstance(pre, tuple) else pre
    stored = torch.from_numpy(data.hidden[: ids.shape[1]]).float()  # [L, H]
    normed = model.model.norm(pre[0])
    torch.testing.assert_close(stored, normed, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(stored, last_layer, atol=2e-2, rtol=1e-2)
    # the LM head over the stored state gives the target's own argmax at every position
    assert torch.equal(model.lm_head(stored).argmax(-1), out.logits[0].argmax(-1))
