"""Training and held-out scoring of the hidden-state draft (specserve/eagle) on distillation features.

Alignment (tested against a hand computation in tests/specserve/training/test_eagle_training.py): a
sequence's position t carries the target's normed final hidden state h[t], token x[t] and the target's
top-k for x[t + 1]. The draft's position t reads (h[t], x[t + 1]) and predicts x[t + 2], so its label is
the target's top-k at t + 1: every array but h drops its first position.

The loss is the distillation loss of `kd.kd_loss` at each unrolled step (`EagleDraft.unrolled`:
step j feeds the draft its own outputs j times, as when it drafts the (j + 1)-th token of a round),
weighted decay**j, over answer positions that have a root j positions back.

Feature noise (EAGLE's augmentation): with `noise` > 0 the target's features are perturbed by uniform noise
in [-noise, noise] per element before the draft reads them, so it learns from states near the recorded ones,
as its own drafted states will be. The draws are a function of (seed, step): a resumed run sees the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from specserve.eagle.model import EagleDraft
from specserve.runtime.layer_outputs import side_by_side
from specserve.training.device import bf16_autocast
from specserve.training.evaluate import Agreement, merge
from specserve.training.features import IGNORE, pad_rows, teacher_forced
from specserve.training.kd import kd_loss

if TYPE_CHECKING:
    from torch import nn

EVAL_STEPS = 5  # lags scored by eval-draft, as for GliDe's block of 5


def shifted_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A distillation batch (FeatureSet.batch with hidden states) -> the draft's view of it, one shorter:
    features [B, S-1, H] = h[t], input_ids [B, S-1] = x[t + 1], topk_ids / topk_probs [B, S-1, K] and
    loss_mask [B, S-1] of position t + 1."""
    return {
        "features": batch["hidden"][:, :-1],
        "input_ids": batch["input_ids"][:, 1:],
        "topk_ids": batch["topk_ids"][:, 1:],
        "topk_probs": batch["topk_probs"][:, 1:],
        "loss_mask": batch["loss_mask"][:, 1:],
    }


def noisy_features(features: torch.Tensor, noise: float, seed: int, step: int) -> torch.Tensor:
    """features [B, S, H] + U(-noise, noise) per element, drawn on their device from a generator seeded
    by (seed, step): the same step of a resumed run draws the same noise. noise 0 -> features as they are."""
    if noise <= 0:
        return features
    generator = torch.Generator(device=features.device)
    generator.manual_seed(seed * 1_000_003 + step)
    uniform = torch.rand(features.shape, generator=generator, device=features.device, dtype=torch.float32)
    return features + (2 * uniform - 1).to(features.dtype) * noise


def eagle_step_loss(
    draft: EagleDraft,
    batch: dict[str, torch.Tensor],
    steps: int,
    decay: float,
    kd_weight: float,
    ce_weight: float,
    bf16: bool,
    noise: float = 0.0,
    noise_seed: tuple[int, int] = (0, 0),
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-> (loss, metrics). `batch` is on the draft's device; the metrics are 0-d tensors there, read
    only when a log line is written, so a GPU is not made to wait for them every step. `noise`: the
    half-width of the uniform feature noise, `noise_seed` its (seed, step)."""
    view = shifted_inputs(batch)
    view["features"] = noisy_features(view["features"].float(), noise, *noise_seed)
    device = view["input_ids"].device
    index = draft.draft_index  # [V] full id -> head row, -100 outside
    width = view["input_ids"].shape[1]
    total = torch.zeros((), device=device)
    metrics: dict[str, torch.Tensor] = {}
    with bf16_autocast(device, bf16):
        outputs = draft.unrolled(view["features"], view["input_ids"], steps)
    for j, predicted in enumerate(outputs):
        rooted = torch.arange(width, device=device) >= j  # [S-1]: a root j positions back exists
        positions = view["loss_mask"] & rooted[None]  # [B, S-1]
        with bf16_autocast(device, bf16):
            scores = draft.draft_logits(predicted[positions])  # [N, V_draft]
        topk = index[view["topk_ids"][positions]]  # [N, K]
        topk = torch.where(topk >= 0, topk, torch.full_like(topk, -1))
        labels = index[view["topk_ids"][positions][:, 0]]  # [N]
        loss, kl, ce = kd_loss(scores, topk, view["topk_probs"][positions], labels, kd_weight, ce_weight)
        total = total + decay**j * loss
        if j == 0:
            with torch.no_grad():
                scored = labels >= 0
                agree = (scores.argmax(-1) == labels) & scored
                metrics = {"kl": kl, "ce": ce, "accuracy": agree.sum() / scored.sum().clamp_min(1)}
    metrics["loss"] = total.detach()
    return total, metrics


@torch.inference_mode()
def held_out_hidden(
    target: nn.Module,  # the frozen HF causal LM
    sequences: Sequence[Sequence[int]],
    answer_starts: Sequence[int],
    pad_id: int,
    batch_size: int = 8,
    output_layers: Sequence[int] = (),
) -> list[dict[str, torch.Tensor]]:
    """The target's side of the evaluation, once: per batch input_ids, labels (the target's argmax,
    IGNORE outside the answers) and hidden [B, S, H], its normed final hidden states (with
    `output_layers`, [B, S, k * H]: those layers' outputs side by side, a fused draft's input). The
    target runs on its device; the batches come back on the CPU (cached on disk, moved to a draft's
    device to score)."""
    device = next(target.parameters()).device
    out = []
    for start in range(0, len(sequences), batch_size):
        rows = sequences[start : start + batch_size]
        lengths = torch.tensor([len(r) for r in rows])
        width = int(lengths.max())
        input_ids = pad_rows(rows, width, pad_id)  # [B, S]
        passed = teacher_forced(target, input_ids.to(device, non_blocking=True), [], output_layers)
        labels = target.lm_head(passed.hidden).argmax(-1).cpu()  # type: ignore[operator]  # [B, S]
        hidden = passed.hidden  # [B, S, H]
        if output_layers:
            hidden = side_by_side(passed.layer_outputs, output_layers)  # [B, S, k * H]
        positions = torch.arange(width)[None]  # [1, S]
        starts = torch.tensor(list(answer_starts[start : start + batch_size]))[:, None]  # [B, 1]
        scored = (positions >= starts) & (positions < lengths[:, None])
        labels = torch.where(scored, labels, torch.full_like(labels, IGNORE))
        out.append({"input_ids": input_ids, "labels": labels, "hidden": hidden.half().cpu()})
    return out


@torch.inference_mode()
def score_eagle(
    draft: EagleDraft, batches: Sequence[dict[str, torch.Tensor]], steps: int = EVAL_STEPS
) -> Agreement:
    """Agreement at lags 1..steps: the j-th drafted token of a round, the j - 1 before it accepted (so
    teacher-forced tokens), the draft reading its own outputs for them as when drafting."""
    parameter = next(draft.parameters())
    dtype, device = parameter.dtype, parameter.device
    parts = []
    for batch in batches:
        features = batch["hidden"][:, :-1].to(device, dtype, non_blocking=True)  # [B, S-1, H]
        ids = batch["input_ids"][:, 1:].to(device, non_blocking=True)  # [B, S-1]
        labels = batch["labels"][:, 1:].to(device, non_blocking=True)  # [B, S-1]
        width = ids.shape[1]
        agreed, scored = [], []
        for j, predicted in enumerate(draft.unrolled(features, ids, steps)):
            mask = (labels != IGNORE) & (torch.arange(width, device=device) >= j)[None]  # [B, S-1]
            guess = draft.top_ids(predicted)  # [B, S-1]
            agreed.append(int(((guess == labels) & mask).sum()))
            scored.append(int(mask.sum()))
        parts.append(Agreement(tuple(agreed), tuple(scored)))
    return merge(parts)
