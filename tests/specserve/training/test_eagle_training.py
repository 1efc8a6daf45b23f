"""Hidden-state draft training (training/eagle.py): the draft's inputs and labels line up by hand,
unrolled training learns, and feature noise is what it claims. Whole runs: distill/test_distill_loop.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve.eagle.model import build_eagle
from specserve.models import load_tokenizer
from specserve.training.distill.feature_extraction import extract_features
from specserve.training.distill.feature_set import FeatureSet
from specserve.training.eagle import (
    eagle_step_loss,
    held_out_hidden,
    noisy_features,
    score_eagle,
    shifted_inputs,
)
from specserve.training.features import IGNORE
from specserve.training.generation import ANSWERS, GenerationSettings, run_stage
from specserve.training.prompt_set import Prompt, user

PROMPTS = [Prompt("test", user(f"Tell me about topic number {i}.")) for i in range(7)]
SETTINGS = GenerationSettings(
    shard_size=4, batch_size=2, max_new_tokens=6, dtype="float32", static_cache=False
)


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval(), load_tokenizer(tiny_target_dir)


@pytest.fixture(scope="module")
def features(tiny, tmp_path_factory) -> Path:
    model, tokenizer = tiny
    root = tmp_path_factory.mktemp("eagle-data")
    run_stage(model, tokenizer, root / "gen" / ANSWERS, lambda: list(PROMPTS), SETTINGS, log=lambda _: None)
    extract_features(model, root / "gen", root / "features", top_k=4, log=lambda _: None)
    return root


def test_the_drafts_position_t_reads_h_t_and_x_t_plus_1_and_learns_x_t_plus_2() -> None:
    hidden = torch.arange(5.0)[None, :, None].expand(1, 5, 3).half()  # h[t] = t
    batch = {
        "hidden": hidden,
        "input_ids": torch.tensor([[10, 11, 12, 13, 14]]),
        "topk_ids": torch.tensor([[[20], [21], [22], [23], [24]]]),  # target's top-1 for x[t + 1]
        "topk_probs": torch.ones(1, 5, 1).half(),
        "loss_mask": torch.tensor([[False, True, True, True, False]]),
    }
    view = shifted_inputs(batch)
    assert view["features"][0, :, 0].tolist() == [0, 1, 2, 3]  # h[t]
    assert view["input_ids"].tolist() == [[11, 12, 13, 14]]  # x[t + 1]
    assert view["topk_ids"][0, :, 0].tolist() == [21, 22, 23, 24]  # the label of x[t + 2]
    assert view["loss_mask"].tolist() == [[True, True, True, False]]


@pytest.mark.parametrize("feature_layers", [(), (0, 1)], ids=["final-hidden", "fused"])
def test_unrolled_training_raises_agreement_on_what_it_saw(tiny, features, feature_layers) -> None:
    model, _ = tiny
    data = FeatureSet.load(features / "features", layers=[], hidden=True, output_layers=feature_layers)
    assert data.hidden is not None
    assert data.hidden.shape[1] == model.config.hidden_size * max(1, len(feature_layers))
    torch.manual_seed(0)
    draft = build_eagle(model, draft_vocab_size=None, feature_layers=feature_layers)
    draft = draft.float().train().requires_grad_(True)
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    batch = data.batch(list(range(len(data))), [])
    losses = []
    for _ in range(40):
        loss, metrics = eagle_step_loss(draft, batch, 3, 0.8, 1.0, 1.0, bf16=False)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(metrics["loss"])
    assert losses[-1] < 0.5 * losses[0], losses
    draft.eval()
    sequences = [list(data.tokens[s : s + n]) for s, n in zip(data.starts, data.lengths, strict=True)]
    batches = held_out_hidden(
        model, sequences, list(data.prompt_lengths), pad_id=0, output_layers=feature_layers
    )
    agreement = score_eagle(draft, batches)
    assert agreement.by_lag[0] > 0.5 and all(n > 0 for n in agreement.scored)
    assert all(int((b["labels"] != IGNORE).sum()) > 0 for b in batches)


def test_feature_noise_is_bounded_uniform_and_a_function_of_seed_and_step() -> None:
    features = torch.randn(4, 64, 32)  # [B, S, H]
    assert noisy_features(features, 0.0, seed=0, step=3) is features
    noisy = noisy_features(features, 0.25, seed=0, step=3)
    delta = noisy - features
    assert float(delta.abs().max()) <= 0.25 + 1e-6
    assert float(delta.abs().max()) > 0.24  # the whole width is used, not a sliver of it
    assert abs(float(delta.abs().mean()) - 0.125) < 0.01  # |U(-w, w)| has mean w / 2
    assert abs(float(delta.mean())) < 0.01  # centred: the features keep their scale
    assert torch.equal(noisy, noisy_features(features, 0.25, seed=0, step=3))
    assert not torch.equal(noisy, noisy_features(features, 0.25, seed=0, step=4))
    assert not torch.equal(noisy, noisy_features(features, 0.25, seed=1, step=3))
