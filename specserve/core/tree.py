"""The one tree representation: nodes in topological order, each with its parent's index.

Node 0 is the root: the last committed token, whose KV the target has not computed yet. Every other
node is a draft candidate. Masks, depths and children are all derived from `parent_ids`.

Worked example (root r with children a, b; a has child c):
    token_ids  = [r, a, b, c]
    parent_ids = [-1, 0, 0, 1]
    depths     = [0, 1, 1, 2]
    mask rows (ancestor-or-self): r=1000, a=1100, b=1010, c=1101
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specserve.errors import InvalidArgument


@dataclass(frozen=True)
class TokenTree:
    token_ids: tuple[int, ...]  # [N]
    parent_ids: tuple[int, ...]  # [N]; parent_ids[0] == -1, parent_ids[i] < i

    def __post_init__(self) -> None:
        validate_parents(self.parent_ids, len(self.token_ids))

    @classmethod
    def chain(cls, token_ids: Sequence[int]) -> TokenTree:
        return cls(tuple(token_ids), tuple(range(-1, len(token_ids) - 1)))

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    def depths(self) -> list[int]:
        return tree_depths(self.parent_ids)

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parent_ids))


def validate_parents(parent_ids: Sequence[int], num_nodes: int) -> None:
    if num_nodes < 1 or len(parent_ids) != num_nodes:
        raise InvalidArgument(f"a tree needs >= 1 node and one parent per node, got {num_nodes} nodes")
    if parent_ids[0] != -1:
        raise InvalidArgument("node 0 must be the root (parent -1)")
    for i in range(1, num_nodes):
        if not 0 <= parent_ids[i] < i:
            raise InvalidArgument(f"node {i} has parent {parent_ids[i]}; parents must precede their children")


def tree_depths(parent_ids: Sequence[int]) -> list[int]:
    depths = [0] * len(parent_ids)
    for i in range(1, len(parent_ids)):
        depths[i] = depths[parent_ids[i]] + 1
    return depths


def tree_children(parent_ids: Sequence[int]) -> list[list[int]]:
    """Children of each node in index order, which is also the order they were proposed in."""
    children: list[list[int]] = [[] for _ in parent_ids]
    for i in range(1, len(parent_ids)):
        children[parent_ids[i]].append(i)
    return children
