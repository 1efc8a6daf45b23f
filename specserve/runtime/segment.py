"""One session's share of a ragged forward: the unit both forwards (`runtime/ragged.py`, transformers'
modules; `runtime/decoder.py`, the lean Llama-family one) take, kept apart from either so neither has to
import the other to name it."""

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
