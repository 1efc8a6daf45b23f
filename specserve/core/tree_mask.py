"""Tree attention masks (torch). Kept apart from core/tree.py so that torch-free code (the router)
can use TokenTree."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def tree_attention_mask(parent_ids: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """[N, N] bool, True where row node may attend column node: its ancestors and itself.

    Row i is its parent's row OR itself (EAGLE's construction); valid because parents precede children.
    """
    n = len(parent_ids)
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        mask[i] |= mask[parent_ids[i]]
    return mask.to(device)
