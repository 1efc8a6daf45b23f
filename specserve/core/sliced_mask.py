"""MCSD's sliced topology-aware mask (Lu et al., arXiv 2409.10644, 4.2b): build once, slice per round.

A static multi-candidate shape k_config = (k_1, ..., k_gamma) gives every node at depth d exactly k_d
children. Nodes are numbered level by level, so the tree drafted by a round that stopped after j
levels is a prefix of the full tree, and its attention mask is the top-left block of the full mask.
Building the full tree once per shape and slicing it turns a per-round mask build into a view.

Node order: level d starts at offset_d = 1 + k_1 + k_1 k_2 + ... (d - 1 products); its node number
offset_d + parent_local * k_d + child is child `child` of the `parent_local`-th node of level d - 1.

Worked example, k_config = (2, 2): 1 + 2 + 4 = 7 nodes.
    parent_ids = [-1, 0, 0, 1, 1, 2, 2]
    depths     = [ 0, 1, 1, 2, 2, 2, 2]
    levels(1) = the first 3 nodes: parents [-1, 0, 0], mask rows 100, 110, 101
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from specserve.core.tree_mask import tree_attention_mask
from specserve.errors import InvalidArgument

MAX_SLICED_NODES = 4096  # the full mask is N x N bools: 16 MB here, and far beyond any useful verify


class TreeLevels(NamedTuple):
    parent_ids: tuple[int, ...]  # [n]; a TokenTree's parent_ids
    mask: torch.Tensor  # [n, n] bool, a view of the full mask
    depths: torch.Tensor  # [n] int64, a view: position id = prefix length + depth


# Tensors have no single truth value, so instances compare by identity; they are cached and shared.
@dataclass(frozen=True, eq=False)
class SlicedTreeMask:
    """The full tree of one static shape. Shared through the cache: never write into its tensors."""

    k_config: tuple[int, ...]  # [gamma]
    parent_ids: tuple[int, ...]  # [N]
    mask: torch.Tensor  # [N, N] bool, row = parent's row OR self
    depths: torch.Tensor  # [N] int64, row sum - 1
    level_ends: tuple[int, ...]  # [gamma + 1]; level_ends[j] = nodes in levels 0..j

    @property
    def gamma(self) -> int:
        return len(self.k_config)

    def num_nodes(self, j: int) -> int:
        """Nodes in the root plus the first j draft levels: 1 + k_1 + k_1 k_2 + ... (j terms)."""
        self._check_level(j)
        return self.level_ends[j]

    def levels(self, j: int) -> TreeLevels:
        """The tree of a round that drafted j levels (0 = root only); slices, never rebuilds."""
        n = self.num_nodes(j)
        return TreeLevels(self.parent_ids[:n], self.mask[:n, :n], self.depths[:n])

    def _check_level(self, j: int) -> None:
        if not 0 <= j <= self.gamma:
            raise InvalidArgument(f"level {j} outside 0..{self.gamma} for shape {self.k_config}")


def multi_candidate_parents(k_config: Sequence[int]) -> tuple[int, ...]:
    """Parent of every node of the full tree, level by level (see the module docstring)."""
    parents = [-1]
    level_offset, level_size = 0, 1  # the previous level: where it starts, how many nodes
    for k in k_config:
        parents.extend(level_offset + local // k for local in range(level_size * k))
        level_offset, level_size = level_offset + level_size, level_size * k
    return tuple(parents)


def sliced_tree_mask(k_config: Sequence[int]) -> SlicedTreeMask:
    """The cached full tree for this shape; built on first use, shared afterwards."""
    shape = tuple(k_config)
    if not shape or any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in shape):
        raise InvalidArgument(f"a multi-candidate shape needs >= 1 level of widths >= 1, got {shape}")
    num_nodes = sum(math.prod(shape[:d]) for d in range(len(shape) + 1))
    if num_nodes > MAX_SLICED_NODES:
        raise InvalidArgument(f"shape {shape} has {num_nodes} nodes; at most {MAX_SLICED_NODES}")
    return _build(shape)


@functools.lru_cache(maxsize=32)
def _build(k_config: tuple[int, ...]) -> SlicedTreeMask:
    parent_ids = multi_candidate_parents(k_config)
    mask = tree_attention_mask(parent_ids)  # [N, N]
    depths = mask.sum(dim=-1) - 1  # [N]
    level_ends = tuple(sum(math.prod(k_config[:d]) for d in range(j + 1)) for j in range(len(k_config) + 1))
    return SlicedTreeMask(k_config, parent_ids, mask, depths, level_ends)
