"""What the frozen target contributes to a training sequence: its K/V of the layers a draft reads, its
final hidden states and its next tokens.

`teacher_forced` is the one forward that gathers them; `target_features` (the training pipeline's
batches, eval-draft) and `distill.feature_extraction.sequence_features` (the distillation feature
shards) shape its output for their readers.

Labels are the target's own greedy next token at every position (self-distillation): the draft is
rewarded for guessing what the target will say, which is exactly what greedy verification accepts,
rather than what the training text happens to say next.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from specserve.runtime.layer_outputs import capture_layer_outputs

IGNORE = -100  # label of padding positions: no loss


@dataclass(frozen=True)
class TargetPass:
    """The target's teacher-forced pass over a right-padded batch [B, S]."""

    hidden: torch.Tensor  # [B, S, H] final hidden states after the last norm: what the LM head reads
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]  # target layer (from 0) -> keys, values [B, Hkv, S, D]
    num_layers: int  # the target's
    # target layer (from 0) -> its output [B, S, H]: the residual stream after that decoder layer, before
    # any norm (the fused input of a multi-layer hidden-state draft, specserve/eagle)
    layer_outputs: dict[int, torch.Tensor] = field(default_factory=dict)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `layer` as `teacher_forced` was asked for it (-1 = the last)."""
        return self.kv[layer % self.num_layers]


@torch.inference_mode()
def teacher_forced(
    model: nn.Module,  # a HF causal LM, frozen: `model.model` is its decoder, `model.lm_head` its head
    input_ids: torch.Tensor,  # [B, S], right-padded
    layers: Sequence[int],  # the layers whose K/V to keep; negative counts from the last
    output_layers: Sequence[int] = (),  # the layers whose outputs to keep (from 0)
) -> TargetPass:
    """One forward of the target's decoder. Right padding keeps every real position's values identical
    to an unpadded run (causal attention never looks right), so no attention mask is needed.

    The logits are left to the caller (`model.lm_head(hidden)`): [B, S, V] may not fit in memory, and
    a caller that cannot hold them forms them a chunk of positions at a time."""
    decoder_layers = cast(nn.ModuleList, model.model.layers)  # type: ignore[union-attr]
    with capture_layer_outputs(list(decoder_layers), output_layers) as outputs:
        out = model.model(input_ids=input_ids, use_cache=True)  # type: ignore[operator]
    cache = out.past_key_values.layers
    kv = {layer % len(cache): (cache[layer].keys, cache[layer].values) for layer in layers}
    return TargetPass(hidden=out.last_hidden_state, kv=kv, num_layers=len(cache), layer_outputs=outputs)


@torch.inference_mode()
def target_features(
    model: nn.Module,  # a HF causal LM, frozen
    input_ids: torch.Tensor,  # [B, S]
    lengths: Sequence[int],  # real tokens per row; the rest is padding (right-padded)
    layer: int,  # which layer's K/V the draft reads; -1 = the last
    extra_layers: Sequence[int] = (),  # more layers, as target_k.<layer> / target_v.<layer>
) -> dict[str, torch.Tensor]:
    """-> labels [B, S] (target argmax, IGNORE on padding), target_k / target_v [B, Hkv, S, D] fp16."""
    target = teacher_forced(model, input_ids, [layer, *extra_layers])
    labels = model.lm_head(target.hidden).argmax(dim=-1)  # type: ignore[operator]  # [B, S]
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)  # [S]
    real = positions[None] < torch.tensor(list(lengths), device=input_ids.device)[:, None]  # [B, S]
    labels = torch.where(real, labels, torch.full_like(labels, IGNORE))
    keys, values = target.layer(layer)
    return {
        "labels": labels.to(torch.int32).cpu(),
        # fp16 halves the shards; the draft trains on the same values it will read at fp16 serving
        # and is robust to the rounding at fp32 serving.
        "target_k": keys.to(torch.float16).cpu(),
        "target_v": values.to(torch.float16).cpu(),
        **{f"target_k.{layer}": target.layer(layer)[0].half().cpu() for layer in extra_layers},
        **{f"target_v.{layer}": target.layer(layer)[1].half().cpu() for layer in extra_layers},
    }


def pad_rows(rows: Sequence[Sequence[int]], length: int, pad_id: int) -> torch.Tensor:
    """Right-pads token rows (each <= length) into [B, length]."""
    batch = torch.full((len(rows), length), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        batch[i, : len(row)] = torch.tensor(list(row), dtype=torch.long)
    return batch


def pack_tokens(documents: Sequence[Sequence[int]], length: int, min_length: int = 16) -> list[list[int]]:
    """Concatenates documents and cuts the stream into rows of `length` tokens.

    Packing wastes nothing on padding; the target sees the same packed row, so its K/V and labels
    stay consistent with what the draft reads. A tail shorter than `min_length` is dropped.
    """
    stream = [t for doc in documents for t in doc]
    rows = [stream[i : i + length] for i in range(0, len(stream), length)]
    return [row for row in rows if len(row) >= min_length]
