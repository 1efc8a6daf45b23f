"""CaPE, confidence-aware proposal expansion (Du et al., ICML 2024): how wide each depth of a draft is.

The draft runs once, greedily, along a spine. At step i its confidence c_i (the largest softmax
probability at T = 1) picks k_i = bins[floor(10 * c_i)] candidates: the spine token plus k_i - 1
leaves beside it, under which nothing is drafted. Unsure steps get more candidates.

Worked example with the official bins (8 8 8 6 6 6 4 4 2 2 2 2) and confidences 0.05, 0.35, 0.65,
0.95: widths 8, 6, 4, 2, a tree of 1 + 20 nodes. Candidates are the draft's top-k (fixed, not
sampled), so verification uses the fixed-candidate rule and needs no draft probabilities.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.errors import InvalidArgument

CAPE_BINS: tuple[int, ...] = (8, 8, 8, 6, 6, 6, 4, 4, 2, 2, 2, 2)  # official, indexed by floor(10 c)


@dataclass(frozen=True)
class CapeSettings:
    bins: tuple[int, ...] = CAPE_BINS
    max_tree_nodes: int = 64  # root included; deeper spine tokens win over wider leaves when capped

    def __post_init__(self) -> None:
        if not self.bins or any(k < 1 for k in self.bins):
            raise InvalidArgument(f"CaPE bins must be >= 1, got {self.bins}")
        if self.max_tree_nodes < 1:
            raise InvalidArgument("max_tree_nodes must be >= 1")


def draft_confidence(logits: torch.Tensor) -> float:
    """logits: [V] raw draft logits -> the largest probability of softmax(logits) at T = 1."""
    return float(torch.softmax(logits.float(), dim=-1).max())


def cape_width(confidence: float, bins: Sequence[int] = CAPE_BINS) -> int:
    """k = bins[floor(10 c)]; c = 1.0 (or rounding above it) takes the last bin."""
    index = min(max(math.floor(10 * confidence), 0), len(bins) - 1)
    return bins[index]


def fit_width(width: int, num_nodes: int, depths_after: int, max_tree_nodes: int) -> int:
    """The width allowed at this depth so the tree stays within `max_tree_nodes`.

    num_nodes: nodes already in the tree; depths_after: spine steps still to come, each of which keeps
    one node in reserve (depth beats width). 0 means the tree is full and drafting stops.
    """
    room = max_tree_nodes - num_nodes
    if room <= 0:
        return 0
    return min(width, max(1, room - depths_after))
