"""Tree helpers the tests share."""

from __future__ import annotations

from collections.abc import Sequence


def path_to_node(parent_ids: Sequence[int], node: int) -> list[int]:
    """Node indices from the root down to `node`, inclusive."""
    path = [node]
    while parent_ids[path[-1]] != -1:
        path.append(parent_ids[path[-1]])
    return path[::-1]
