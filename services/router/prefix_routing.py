"""Which target replica probably holds a prompt's prefix: what this router sent where.

Each target keeps its own prefix cache (runtime/prefix_cache.py) in blocks of its prefill chunk, keyed by
tenant and token prefix. The router cannot see those caches; it remembers, per replica, the block chains
of the prompts it placed there (least recently used forgotten past `max_blocks` per replica), and a new
session goes to the replica holding the longest chain of its prompt, unless that replica is busier than
the least loaded by more than the placement's slack (services/router/placement.py). A guess: the target
may have evicted the blocks since, or another router may have filled another replica; a wrong guess
costs a cold prefill, never a wrong answer.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from specserve.core.prompt_indexes import block_digests


def block_keys(tenant: str, token_ids: Sequence[int], block_tokens: int) -> list[bytes]:
    """One key per whole block of the prompt (its last token excluded, as the target computes that one
    itself): each digests its tenant and every token up to the block's end, so equal keys mean equal
    prefixes."""
    return block_digests(tenant, token_ids, block_tokens, max(0, len(token_ids) - 1) // block_tokens)


class PrefixDirectory:
    """Thread-safe; per replica an LRU set of block keys."""

    def __init__(self, block_tokens: int, max_blocks: int = 4096) -> None:
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self._held: dict[str, OrderedDict[bytes, None]] = {}
        self._lock = threading.Lock()

    def matched_blocks(
        self, tenant: str, token_ids: Sequence[int], addresses: Sequence[str]
    ) -> dict[str, int]:
        """Per address, how many leading blocks of the prompt this router placed there."""
        keys = block_keys(tenant, token_ids, self.block_tokens)
        out = {}
        with self._lock:
            for address in addresses:
                held = self._held.get(address, OrderedDict())
                out[address] = next((i for i, key in enumerate(keys) if key not in held), len(keys))
        return out

    def record(self, address: str, tenant: str, token_ids: Sequence[int]) -> None:
        """The prompt was prefilled on `address`: its blocks are probably cached there now."""
        keys = block_keys(tenant, token_ids, self.block_tokens)
        with self._lock:
            held = self._held.setdefault(address, OrderedDict())
            for key in keys:
                held[key] = None
                held.move_to_end(key)
            while len(held) > self.max_blocks:
                held.popitem(last=False)
