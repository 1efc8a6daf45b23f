"""The loss of one GliDe training step: kd_weight * KL(target top-k, renormalised || draft) + ce_weight *
CE(draft, argmax), over the answer positions (from the last prompt token on), under training's block-wise
cross mask. A hidden-state draft's step is `training/eagle.py`'s."""

from __future__ import annotations

import torch

from specserve.glide.model import GlideDraft, blockwise_cross_mask
from specserve.training.device import bf16_autocast
from specserve.training.distill.settings import DistillSettings
from specserve.training.kd import kd_loss


def step_loss(
    draft: GlideDraft, batch: dict[str, torch.Tensor], settings: DistillSettings
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-> (loss, metrics). `batch` is on the draft's device; the metrics are 0-d tensors there, read
    only when a log line is written, so a GPU is not made to wait for them every step."""
    dtype = torch.float32
    device = batch["input_ids"].device
    width = batch["input_ids"].shape[1]
    cross = blockwise_cross_mask(width, draft.config.block_size).to(device)  # [S, S]
    blocks = range(draft.config.num_layers)
    kv = [(batch[f"target_k.{i}"].to(dtype), batch[f"target_v.{i}"].to(dtype)) for i in blocks]
    with bf16_autocast(device, settings.bf16):
        hidden = draft(batch["input_ids"], kv, cross)  # [B, S, H]
        positions = batch["loss_mask"]  # [B, S]
        scores = draft.draft_logits(hidden[positions])  # [N, V_draft]
    index = draft.draft_index  # [V] full id -> head index, -100 outside
    topk = index[batch["topk_ids"][positions]]  # [N, K]
    topk = torch.where(topk >= 0, topk, torch.full_like(topk, -1))
    labels = index[batch["topk_ids"][positions][:, 0]]  # [N]
    loss, kl, ce = kd_loss(
        scores, topk, batch["topk_probs"][positions], labels, settings.kd_weight, settings.ce_weight
    )
    with torch.no_grad():
        scored = labels >= 0
        agree = (scores.argmax(-1) == labels) & scored
        accuracy = agree.sum() / scored.sum().clamp_min(1)
    return loss, {"loss": loss.detach(), "kl": kl, "ce": ce, "accuracy": accuracy}
