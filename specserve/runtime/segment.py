"""One session's share of a ragged forward (`Segment`) and one forward over many of them
(`ForwardBatch`): what both forwards (`runtime/ragged.py`, transformers' modules; `runtime/decoder.py`,
the lean Llama-family one) take, kept apart from either so neither has to import the other to name it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.runtime.kv_cache import PositionalKVCache


@dataclass(frozen=True)
class Segment:
    """One session's share of a forward: `token_ids` appended after its cache's committed positions.

    attend None means a causal chain; otherwise row i may attend cache slot j where attend[i, j]
    (trees, grown trees), over every slot up to and including the segment's own tokens.
    """

    cache: PositionalKVCache
    token_ids: Sequence[int]
    positions: torch.Tensor  # [n] position ids
    attend: torch.Tensor | None = None  # [n, cache.length + n] bool
    last_only: bool = False  # only the last token's logits are needed (prefill, chain sync)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def causal_attend(prefix: int, n: int, device: torch.device) -> torch.Tensor | None:
    """[n, prefix + n] bool: a chain's mask; None for one token (it sees every slot)."""
    if n == 1:
        return None
    seen = torch.ones(n, prefix, dtype=torch.bool, device=device)  # [n, prefix]
    chain = torch.ones(n, n, dtype=torch.bool, device=device).tril()  # [n, n]
    return torch.cat([seen, chain], dim=1)


@dataclass(frozen=True)
class ForwardBatch:
    """One forward over many sessions, described once and passed down: the packed tokens and
    positions, where each segment sits in them, each segment's mask over its own cache, and the rows
    whose logits are returned. Built by `of`, which also grows each cache to hold its new positions
    (a segment's K/V lands at [cache.length, cache.length + n)); every layer's attention reads it."""

    segments: tuple[Segment, ...]
    token_ids: torch.Tensor  # [N] the segments' tokens, packed in order
    positions: torch.Tensor  # [N] their position ids
    bounds: tuple[tuple[int, int], ...]  # [start, end) of each segment in the packed sequence
    masks: tuple[torch.Tensor | None, ...]  # [1, 1, n, prefix + n] bool each; None = attend everything
    keep: tuple[int, ...]  # packed rows whose logits are returned (last_only keeps a segment's last)

    @classmethod
    def of(cls, segments: Sequence[Segment], device: torch.device) -> ForwardBatch:
        bounds: list[tuple[int, int]] = []
        masks: list[torch.Tensor | None] = []
        keep: list[int] = []
        start = 0
        for segment in segments:
            n = segment.num_tokens
            prefix = segment.cache.length
            segment.cache.ensure_capacity(prefix + n)
            attend = segment.attend if segment.attend is not None else causal_attend(prefix, n, device)
            masks.append(None if attend is None else attend.to(device)[None, None])  # [1, 1, n, prefix + n]
            bounds.append((start, start + n))
            keep.extend([start + n - 1] if segment.last_only else range(start, start + n))
            start += n
        token_ids = torch.tensor([t for s in segments for t in s.token_ids], device=device)  # [N]
        positions = torch.cat([s.positions.to(device) for s in segments])  # [N]
        return cls(tuple(segments), token_ids, positions, tuple(bounds), tuple(masks), tuple(keep))

    def split_logits(self, logits: torch.Tensor) -> list[torch.Tensor]:
        """[len(keep), V] -> each segment's [n, V] (or [V] if last_only)."""
        results, row = [], 0
        for segment in self.segments:
            rows = 1 if segment.last_only else segment.num_tokens
            chunk = logits[row : row + rows]
            results.append(chunk[-1] if segment.last_only else chunk)
            row += rows
        return results
