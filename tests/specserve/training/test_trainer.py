"""Draft training without Ray: schedule, loss going down, head initialised from the target, checkpoints."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve.glide import blockwise_cross_mask, load_glide
from specserve.training.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from specserve.training.features import pad_rows, target_features
from specserve.training.settings import TrainSettings
from specserve.training.trainer import draft_loss, make_scheduler, new_draft, train_step, warmup_cosine

SEQ = 24


def test_warmup_cosine_shape() -> None:
    assert warmup_cosine(0, 100, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(9, 100, 0.1) == pytest.approx(1.0)
    assert warmup_cosine(10, 100, 0.1) == pytest.approx(1.0)
    assert warmup_cosine(55, 100, 0.1) == pytest.approx(0.5)
    assert warmup_cosine(100, 100, 0.1) == pytest.approx(0.0)


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()


@pytest.fixture(scope="module")
def batch(target) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(100, 400, (4, SEQ), generator=generator).tolist()
    input_ids = pad_rows(rows, SEQ, pad_id=0)
    return {"input_ids": input_ids, **target_features(target, input_ids, [SEQ] * 4, layer=-1)}


def _settings(tmp_path, **overrides) -> TrainSettings:
    return TrainSettings(
        data_dir=tmp_path, out_dir=tmp_path, model_dir=tmp_path, draft_vocab_size=None, **overrides
    )


def test_head_and_norm_start_as_the_targets(tmp_path, target) -> None:
    draft = new_draft(_settings(tmp_path, init_from_target_layer=True), target, target_layer=-1)
    torch.testing.assert_close(draft.lm_head.weight, target.get_output_embeddings().weight)
    torch.testing.assert_close(draft.norm.weight, target.model.norm.weight)
    layer = target.model.layers[-1]
    torch.testing.assert_close(draft.layers[0].cross_attn.q_proj.weight, layer.self_attn.q_proj.weight)
    torch.testing.assert_close(draft.layers[0].mlp.down_proj.weight, layer.mlp.down_proj.weight)
    assert all(p.requires_grad for p in draft.parameters())
    assert "embed_tokens.weight" not in dict(draft.named_parameters())  # shared and frozen


def test_a_frozen_head_stays_the_targets_while_the_block_trains(tmp_path, target, batch) -> None:
    draft = new_draft(_settings(tmp_path, freeze_head=True), target, target_layer=-1)
    assert not draft.lm_head.weight.requires_grad
    before = draft.layers[0].mlp.down_proj.weight.clone()
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    train_step(draft, batch, blockwise_cross_mask(SEQ, 5), optimizer, make_scheduler(optimizer, 5, 0.1), 1.0)
    torch.testing.assert_close(draft.lm_head.weight, target.get_output_embeddings().weight)
    assert not torch.equal(draft.layers[0].mlp.down_proj.weight, before)


def _optimizer(draft, steps: int = 30):
    optimizer = torch.optim.AdamW(draft.parameters(), lr=3e-3, betas=(0.9, 0.95))
    return optimizer, make_scheduler(optimizer, steps, 0.1)


@pytest.mark.parametrize(("cross_attention", "bf16"), [(True, False), (False, False), (True, True)])
def test_a_few_steps_lower_the_loss(tmp_path, target, batch, cross_attention, bf16) -> None:
    draft = new_draft(_settings(tmp_path, cross_attention=cross_attention), target, target_layer=-1)
    mask = blockwise_cross_mask(SEQ, 5)
    optimizer, scheduler = _optimizer(draft)
    first, _ = draft_loss(draft, batch, mask)
    for _ in range(30):
        train_step(draft, batch, mask, optimizer, scheduler, grad_clip=1.0, bf16=bf16)
    last, accuracy = draft_loss(draft, batch, mask)
    assert float(last) < 0.5 * float(first)
    assert float(accuracy) > 0.5


def test_resuming_from_a_checkpoint_continues_exactly(tmp_path, target, batch) -> None:
    mask = blockwise_cross_mask(SEQ, 5)
    straight = new_draft(_settings(tmp_path), target, -1)
    optimizer, scheduler = _optimizer(straight)
    for _ in range(6):
        train_step(straight, batch, mask, optimizer, scheduler, 1.0)

    first = new_draft(_settings(tmp_path), target, -1)
    optimizer, scheduler = _optimizer(first)
    for _ in range(3):
        train_step(first, batch, mask, optimizer, scheduler, 1.0)
    save_checkpoint(tmp_path / "ckpt", first, optimizer, {"step": 3, "epoch": 0, "batches_in_epoch": 3})

    resumed = new_draft(_settings(tmp_path, seed=7), target, -1)  # different init: the checkpoint wins
    optimizer = torch.optim.AdamW(resumed.parameters(), lr=3e-3, betas=(0.9, 0.95))
    state = load_checkpoint(latest_checkpoint(tmp_path / "ckpt"), resumed, optimizer)
    assert state == {"step": 3, "epoch": 0, "batches_in_epoch": 3}
    scheduler = make_scheduler(optimizer, 30, 0.1, start_step=3)
    for _ in range(3):
        train_step(resumed, batch, mask, optimizer, scheduler, 1.0)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_checkpoint_is_a_loadable_draft_and_old_ones_are_pruned(tmp_path, target) -> None:
    draft = new_draft(_settings(tmp_path), target, -1)
    optimizer, _ = _optimizer(draft)
    for step in (1, 2, 3):
        save_checkpoint(
            tmp_path / "ckpt", draft, optimizer, {"step": step, "epoch": 0, "batches_in_epoch": step}
        )
    kept = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert kept == ["step-000002", "step-000003"]
    loaded = load_glide(tmp_path / "ckpt" / "step-000003", target)
    torch.testing.assert_close(loaded.lm_head.weight, draft.lm_head.weight)
