"""`specserve eval-draft`: how often a draft agrees with the target on answers it never trained on.

The target answers held-out prompts (MT-Bench first turns: evaluation only, never training data)
greedily; those answers are cached. Then, teacher-forced and in one pass, the target gives its K/V of
the layer the draft reads and its argmax at every position, and the draft predicts every answer
position under the training's block-wise cross mask. The mask gives each query a lag: the query at lag j
sees the target's K/V up to j positions back, exactly what the j-th token of a round sees when drafting
(the root at lag 1). Agreement at lag j is therefore the chance the j-th drafted token of a chain is
accepted under greedy verification, given the ones before it were: the number that decides speed, in
seconds per draft instead of a benchmark's minutes, and comparable across training runs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from specserve.core.cost import expected_tokens
from specserve.glide.model import GlideDraft, blockwise_cross_mask, trained_cross_lengths
from specserve.training.device import to_device
from specserve.training.features import IGNORE, pad_rows, target_features

if TYPE_CHECKING:
    from specserve.models.loading import CausalLM


@dataclass(frozen=True)
class Agreement:
    """Top-1 agreement of a draft with the target, per lag (1 = the root's proposal)."""

    agreed: tuple[int, ...]  # [block_size] agreements at lag 1 .. block_size
    scored: tuple[int, ...]  # [block_size] positions scored at each lag

    @property
    def by_lag(self) -> list[float]:
        return [a / s if s else 0.0 for a, s in zip(self.agreed, self.scored, strict=True)]

    @property
    def overall(self) -> float:
        return sum(self.agreed) / max(1, sum(self.scored))

    def chain_accepted(self, depth: int) -> float:
        """Expected accepted tokens of a greedy chain of `depth` (<= block_size), treating the lags'
        agreements as independent: sum_i prod_{j <= i} a_j."""
        if not 1 <= depth <= len(self.agreed):
            raise ValueError(f"depth must be in [1, {len(self.agreed)}]")
        return expected_tokens(self.by_lag[:depth]) - 1.0

    def to_json(self) -> dict[str, Any]:
        return {
            "overall": self.overall,
            "by_lag": self.by_lag,
            "scored_by_lag": list(self.scored),
            "chain_accepted": {d: self.chain_accepted(d) for d in range(1, len(self.agreed) + 1)},
        }


def lag_of_positions(seq_len: int, block_size: int) -> torch.Tensor:
    """[S] lag of each training position under the block mask: how far back its newest visible target
    position is; 0 in the first block, whose queries also see their own position (never at inference)."""
    positions = torch.arange(seq_len)  # [S]
    return positions + 1 - trained_cross_lengths(positions, block_size)


def count_agreement(
    predicted: torch.Tensor,  # [B, S] the draft's argmax (full vocabulary ids)
    labels: torch.Tensor,  # [B, S] the target's argmax (IGNORE = not scored)
    block_size: int,
) -> Agreement:
    """Agreements and scored positions per lag 1..block_size; lag 0 (first block) is never scored."""
    lags = lag_of_positions(labels.shape[1], block_size)[None].expand_as(labels)  # [B, S]
    scored = labels != IGNORE  # [B, S]
    agree = (predicted == labels) & scored
    return Agreement(
        agreed=tuple(int(agree[lags == lag].sum()) for lag in range(1, block_size + 1)),
        scored=tuple(int(scored[lags == lag].sum()) for lag in range(1, block_size + 1)),
    )


def merge(parts: Sequence[Agreement]) -> Agreement:
    return Agreement(
        agreed=tuple(sum(p.agreed[i] for p in parts) for i in range(len(parts[0].agreed))),
        scored=tuple(sum(p.scored[i] for p in parts) for i in range(len(parts[0].scored))),
    )


@torch.inference_mode()
def evaluate_draft(
    target: nn.Module,  # the frozen HF causal LM
    draft: GlideDraft,
    sequences: Sequence[Sequence[int]],  # prompt + the target's greedy answer, token ids
    answer_starts: Sequence[int],  # index of each sequence's first answer token
    pad_id: int,
    batch_size: int = 4,
    progress: bool = True,
) -> Agreement:
    """Teacher-forced agreement on the answer positions (input = an answer token, label = the target's
    argmax for the next one), under the training block mask of the draft's block size."""
    batches = held_out_features(
        target, sequences, answer_starts, pad_id, draft.config.feed_layers, batch_size, progress
    )
    return score_draft(draft, batches, draft.config.block_size)


@torch.inference_mode()
def held_out_features(
    target: nn.Module,
    sequences: Sequence[Sequence[int]],
    answer_starts: Sequence[int],
    pad_id: int,
    layers: Sequence[int],
    batch_size: int = 4,
    progress: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """The target's side of the evaluation, once: per batch input_ids, labels (IGNORE outside the
    answers) and the K/V of each of `layers` (k.<layer> / v.<layer>, numbered as given); `score_draft`
    then scores any draft that reads those layers. The target runs on its device; the batches come back
    on the CPU (cached on disk, moved to a draft's device to score)."""
    from tqdm import tqdm

    device = next(target.parameters()).device
    out = []
    batches = range(0, len(sequences), batch_size)
    for start in tqdm(batches, desc="eval-draft", unit="batch", disable=not progress):
        rows = sequences[start : start + batch_size]
        lengths = [len(r) for r in rows]
        width = max(lengths)
        input_ids = pad_rows(rows, width, pad_id)  # [B, S]
        on_device = input_ids.to(device, non_blocking=True)
        features = target_features(target, on_device, lengths, layers[0], layers[1:])  # on the CPU
        labels = features["labels"].long()  # [B, S]
        positions = torch.arange(width)[None]  # [1, S]
        starts = torch.tensor(list(answer_starts[start : start + batch_size]))[:, None]  # [B, 1]
        labels = torch.where(positions >= starts, labels, torch.full_like(labels, IGNORE))
        kv = {f"k.{layers[0]}": features["target_k"], f"v.{layers[0]}": features["target_v"]}
        for layer in layers[1:]:
            kv |= {f"k.{layer}": features[f"target_k.{layer}"], f"v.{layer}": features[f"target_v.{layer}"]}
        out.append({"input_ids": input_ids, "labels": labels, **kv})
    return out


@torch.inference_mode()
def score_draft(draft: GlideDraft, batches: Sequence[dict[str, torch.Tensor]], block_size: int) -> Agreement:
    """Agreement of `draft` on `held_out_features`' batches (on the CPU), run on the draft's device."""
    parameter = next(draft.parameters())
    dtype, device = parameter.dtype, parameter.device
    parts = []
    for batch in batches:
        width = batch["input_ids"].shape[1]
        layers = draft.config.layers_read
        moved = to_device(batch, device)  # K/V still fp16: half the bytes to a GPU
        kv = [(moved[f"k.{layer}"].to(dtype), moved[f"v.{layer}"].to(dtype)) for layer in layers]
        cross = blockwise_cross_mask(width, block_size).to(device)  # [S, S]
        hidden = draft(moved["input_ids"], kv, cross)  # [B, S, H]
        predicted = draft.top_ids(hidden).cpu()  # [B, S] full ids, beside the labels
        parts.append(count_agreement(predicted, batch["labels"], block_size))
    return merge(parts)


def held_out_answers(
    target: CausalLM,
    tokenizer: Any,
    prompts: Sequence[str],
    max_new_tokens: int,
    cache_path: Path,
    batch_size: int = 8,
) -> tuple[list[list[int]], list[int]]:
    """(prompt + greedy answer ids, answer start) per prompt; generated once, then read from
    `cache_path` (JSON of token ids: nothing executable is ever loaded)."""
    from tqdm import tqdm

    from specserve.models import encode_chat
    from specserve.training.answers import generate_answers

    key = {"prompts": list(prompts), "max_new_tokens": max_new_tokens}
    if cache_path.is_file():
        cached = json.loads(cache_path.read_text())
        if cached.get("key") == key:
            return cached["sequences"], cached["answer_starts"]
    sequences: list[list[int]] = []
    for start in tqdm(range(0, len(prompts), batch_size), desc="target answers", unit="batch"):
        sequences += generate_answers(target, tokenizer, prompts[start : start + batch_size], max_new_tokens)
    starts = [len(encode_chat(tokenizer, p)) for p in prompts]
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    record = {"key": key, "sequences": sequences, "answer_starts": starts}
    cache_path.write_text(json.dumps(record))
    return sequences, starts
