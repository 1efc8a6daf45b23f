"""The distillation loss of every draft trained on the target's top-k: GliDe's (distill/glide_loss.py) and
the hidden-state draft's (eagle.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.training.features import IGNORE


def kd_loss(
    scores: torch.Tensor,  # [N, V_draft] draft logits
    topk_index: torch.Tensor,  # [N, K] the target's top-k as draft-head indices; -1 = outside the head
    topk_probs: torch.Tensor,  # [N, K] the target's probabilities of those tokens
    labels: torch.Tensor,  # [N] the target's argmax as a draft-head index; IGNORE = no loss
    kd_weight: float = 1.0,
    ce_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (loss, kl, ce). KL(p || q) with p the target's top-k renormalised over the tokens the head can
    score, q the draft's softmax over its head; averaged over positions with any such token. CE against
    the argmax, averaged over positions whose label the head can score."""
    log_q = F.log_softmax(scores.float(), dim=-1)  # [N, V_draft]
    valid = topk_index >= 0  # [N, K]
    p = torch.where(valid, topk_probs.float(), torch.zeros_like(topk_probs, dtype=torch.float32))
    mass = p.sum(-1, keepdim=True)  # [N, 1]
    rows = mass.squeeze(-1) > 0  # [N]
    p = p / mass.clamp_min(1e-12)
    log_q_topk = log_q.gather(-1, topk_index.clamp_min(0))  # [N, K]
    per_row = (p * (torch.log(p.clamp_min(1e-12)) - log_q_topk)).masked_fill(~valid, 0.0).sum(-1)  # [N]
    kl = per_row[rows].mean() if rows.any() else scores.sum() * 0.0
    scored = labels != IGNORE
    ce = F.nll_loss(log_q[scored], labels[scored]) if scored.any() else scores.sum() * 0.0
    return kd_weight * kl + ce_weight * ce, kl.detach(), ce.detach()
