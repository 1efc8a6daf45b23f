"""GliDe forwards of many sessions at once (continuous batching, runtime/batching.py).

Each session's tokens run through the draft block on their own: the block is small and every session
attends its own cache and its own target K/V. The LM head, the largest matrix of a one-layer draft
([V, H] against one row per session), runs once over every session's last hidden state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.glide.model import GlideDraft, TargetKV
from specserve.runtime.batching import shared_batcher
from specserve.runtime.kv_cache import PositionalKVCache


@dataclass(frozen=True)
class GlideSegment:
    """One session's draft forward: `token_ids` at positions start.., appended to its draft cache."""

    cache: PositionalKVCache  # the draft's own KV; holds exactly the positions before `start`
    token_ids: Sequence[int]
    start: int
    cross_mask: torch.Tensor | None  # [n, L] bool over the target positions; None = all of them
    target_kv: Sequence[TargetKV]  # per draft block: ([1, Hkv_t, L, Dt], same) of the layer it reads

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class GlideBatcher:
    """The batched form of one GlideDraft: logits [V] after each segment's last token."""

    label = "draft"  # names its forwards in batching statistics
    priority = -1  # draft forwards run before target forwards (runtime/batching.py)

    def __init__(self, model: GlideDraft) -> None:
        self.model = model
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def forward_batch(self, segments: Sequence[GlideSegment]) -> list[torch.Tensor]:
        last = []
        for segment in segments:
            n = len(segment.token_ids)
            input_ids = torch.tensor([list(segment.token_ids)], device=self.device)  # [1, n]
            positions = torch.arange(segment.start, segment.start + n, device=self.device)  # [n]
            hidden = self.model(input_ids, segment.target_kv, segment.cross_mask, positions, segment.cache)
            last.append(hidden[0, -1])  # [H]
        logits = self.model.logits(torch.stack(last)).float()  # [B, V]
        return list(logits.unbind(0))


def glide_batcher(model: GlideDraft) -> GlideBatcher:
    """The one batcher of `model` (runtime/batching.py `shared_batcher`)."""
    return shared_batcher(model, GlideBatcher)
