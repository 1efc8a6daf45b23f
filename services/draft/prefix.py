"""The draft's prefix cache: the mirrored target K/V (and hidden states) of whole prompt blocks, kept across
sessions, so a session whose prompt starts with cached blocks is fed over the KV feed only what follows.

It is the target's cache (specserve/runtime/prefix_cache.py) over another source: the mirror holds only
the layers the session's drafter reads, so a block is scoped by what it holds as well as by its tenant.
A scope is (tenant, target address, K/V layers, hidden states or not): another tenant never reuses a block
(as on the target), nor another kind of drafter, nor a session on another target replica. The replica is
in the scope because a block must be exactly what that session's own feed would have sent: replicas on
other hardware can differ in the last bits, and the router places a prefix on the replica holding it.

Which positions: only whole blocks of the prompt (`DraftPrefillRequest.num_prompt_tokens`), which the
target computed by prefill, so they are bit for bit what a cold prefill computes (a block is one of its
prefill chunks, or finer where its rows are independent of the chunk: runtime/prefix_cache.py).
Generated tokens' K/V come from verify forwards; a later prompt that contains them is prefilled, and its
K/V differ in the last bits. The block is the target's as it publishes it
(`ModelInfo.prefix_cache_block_tokens`); a target that publishes none (its cache off) is not cached for.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from services.draft.mirror import KVMirror
from specserve.runtime.prefix_cache import PrefixCache


@dataclass(frozen=True)
class MirrorScope:
    tenant: str
    target_address: str
    layers: tuple[int, ...]  # the target layers whose K/V the mirror holds
    hidden_states: bool

    @property
    def key(self) -> str:
        """The cache's namespace: repr of a tuple of plain values, so distinct scopes never collide."""
        return repr((self.tenant, self.target_address, self.layers, self.hidden_states))

    @classmethod
    def of(cls, tenant: str, target_address: str, mirror: KVMirror) -> MirrorScope:
        return cls(tenant, target_address, tuple(mirror.layers), mirror.wants_hidden_states)


@dataclass
class PendingPrompt:
    """A session's prompt blocks, inserted once the mirror holds them all (`MirrorPrefixCache.offer`)."""

    cache: PrefixCache
    scope: MirrorScope
    token_ids: tuple[int, ...]  # the prompt's whole blocks
    done: bool = False


class MirrorPrefixCache:
    """One PrefixCache for the service, made at the first target that publishes its block size."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.cache: PrefixCache | None = None
        self._lock = threading.Lock()

    def for_block(self, block_tokens: int) -> PrefixCache | None:
        """The cache for a target whose prefix blocks are `block_tokens` (0: it publishes none). None when
        off, or the target's block is not the cache's: a block must end where the target's do."""
        if self.budget_bytes == 0 or block_tokens < 1:
            return None
        with self._lock:
            if self.cache is None:
                self.cache = PrefixCache(self.budget_bytes, block_tokens)
        return self.cache if self.cache.block_tokens == block_tokens else None

    def load(
        self,
        block_tokens: int,
        scope: MirrorScope,
        mirror: KVMirror,
        token_ids: Sequence[int],
        num_prompt_tokens: int,
    ) -> tuple[int, PendingPrompt | None]:
        """Before the session's feed starts: loads its longest cached prefix into the empty `mirror`.
        Returns how many positions it holds and what the session inserts later (None: nothing)."""
        cache = self.for_block(block_tokens)
        # The prompt, never the root: the mirror holds committed positions before it.
        prompt = token_ids[: max(0, min(num_prompt_tokens, len(token_ids) - 1))]
        if cache is None or len(prompt) < cache.block_tokens:
            return 0, None
        lease = cache.acquire(scope.key, prompt, len(prompt), () if scope.hidden_states else None)
        cached = lease.num_tokens  # read before the release empties the lease
        try:
            if lease.blocks:
                mirror.load_prefix(lease.kv(), lease.features() if scope.hidden_states else None)
        finally:
            cache.release(lease)
        whole = len(prompt) // cache.block_tokens * cache.block_tokens
        return cached, PendingPrompt(cache, scope, tuple(prompt[:whole]))

    @staticmethod
    def offer(pending: PendingPrompt, mirror: KVMirror) -> None:
        """After a chunk reached the mirror: inserts the prompt's blocks once it holds them all."""
        if pending.done or mirror.length < len(pending.token_ids):
            return
        pending.done = True
        pending.cache.insert_from(pending.scope.key, pending.token_ids, mirror)
