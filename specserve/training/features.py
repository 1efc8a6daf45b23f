"""What the frozen target contributes to a training sequence: its KV of one layer and its next tokens.

Labels are the target's own greedy next token at every position (self-distillation): the draft is
rewarded for guessing what the target will say, which is exactly what greedy verification accepts,
rather than what the training text happens to say next.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

IGNORE = -100  # label of padding positions: no loss


@torch.inference_mode()
def target_features(
    model: nn.Module,  # a HF causal LM, frozen
    input_ids: torch.Tensor,  # [B, S]
    lengths: Sequence[int],  # real tokens per row; the rest is padding (right-padded)
    layer: int,  # which layer's K/V the draft reads; -1 = the last
    extra_layers: Sequence[int] = (),  # more layers, as target_k.<layer> / target_v.<layer>
) -> dict[str, torch.Tensor]:
    """-> labels [B, S] (target argmax, IGNORE on padding), target_k / target_v [B, Hkv, S, D] fp16.

    Right padding keeps every real position's K/V identical to an unpadded run (causal attention
    never looks right), so no attention mask is needed.
    """
    out = model(input_ids=input_ids, use_cache=True)
    cache = out.past_key_values
    layer_cache = cache.layers[layer]
    labels = out.logits.argmax(dim=-1)  # [B, S]
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)  # [S]
    real = positions[None] < torch.tensor(list(lengths), device=input_ids.device)[:, None]  # [B, S]
    labels = torch.where(real, labels, torch.full_like(labels, IGNORE))
    return {
        "labels": labels.to(torch.int32).cpu(),
        # fp16 halves the shards; the draft trains on the same values it will read at fp16 serving
        # and is robust to the rounding at fp32 serving.
        "target_k": layer_cache.keys.to(torch.float16).cpu(),
        "target_v": layer_cache.values.to(torch.float16).cpu(),
        **{f"target_k.{layer}": cache.layers[layer].keys.half().cpu() for layer in extra_layers},
        **{f"target_v.{layer}": cache.layers[layer].values.half().cpu() for layer in extra_layers},
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
