"""A prefix cache across requests: the K/V (and hidden-state features) of whole prompt blocks, reused by the
next prefill that starts with the same tokens.

Blocks form a hash chain keyed exactly by (tenant, parent block, the block's tokens), so a block stands for
its whole prefix and a lookup walks the chain from the first block until a key is missing. A tenant's
blocks serve only that tenant: another tenant's identical prompt finds nothing, so neither its output
nor its latency tells whether anyone sent that prompt.

How big a block is (`block_tokens_for`): on a dense model a block is one prefill chunk (runtime/target.py).
There the K/V of a position depend, in the last float bits, on the shape of the forward that computed it
(how many rows its matrix products had and how they were split over threads; measured on SmolLM2 with 2
threads: a chunk starting 64 tokens into a 256 chunk changed keys by ~4e-5). A prefill computes its prompt
in chunks at absolute multiples of the chunk, cache or not, and a cached prefix is whole chunks, so each
reused block was computed by exactly the forward a cold prefill runs, and the rest of the prompt by the
same chunks: the logits are bit for bit those of a cold prefill, and so is every token chosen from them
(greedy or sampled). On a runner whose rows are independent of each other (`ModelRunner.rows_independent`:
the file's own weights on the CPU's kernels) a position's K/V are the same bits however the prompt was
cut, so blocks are `FINE_BLOCK_TOKENS` and a request recomputes at most that many tokens of a cached
prefix. A draft model's own blocks stay whole chunks of its own (`DraftBlocks`): drafts run dense.

Memory: the cache holds at most `budget_bytes` of block tensors; an insert past it evicts the least
recently used blocks that no session is loading and that no cached block extends (a chain loses its
tail first). A lookup pins its blocks until they are copied into the session's own cache (`Lease`), so
an eviction never counts as freed what a loading session still reads.

What a block holds comes from a `BlockSource`: a session's own cache (`SessionBlocks`), or any other copy
of positions a prefill computed in whole chunks (the draft service's mirror of the target's K/V), which
reads a lease back with `Lease.kv` and `Lease.features`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specserve.errors import InvalidArgument
from specserve.runtime.kv_cache import PositionalKVCache

ROOT = -1  # the parent id of a chain's first block
# Blocks where rows are independent: a later request recomputes under 32 tokens of its cached prefix, and a
# 1,500-token prompt is ~47 blocks to look up and copy.
FINE_BLOCK_TOKENS = 32


class RowsRunner(Protocol):
    @property
    def rows_independent(self) -> bool: ...


def block_tokens_for(runner: RowsRunner, prefill_chunk: int) -> int:
    """The cache's block for a target `runner` prefilling in chunks of `prefill_chunk` (module doc)."""
    if runner.rows_independent and prefill_chunk % FINE_BLOCK_TOKENS == 0:
        return FINE_BLOCK_TOKENS
    return prefill_chunk


def blocks_fit(block_tokens: int, prefill_chunk: int, rows_independent: bool) -> bool:
    """Whether a prefill in chunks of `prefill_chunk` may start at the end of any cached block: the block
    is the chunk, or rows are independent and blocks tile the chunk."""
    return block_tokens == prefill_chunk or (rows_independent and prefill_chunk % block_tokens == 0)


@dataclass(eq=False)
class Block:
    block_id: int
    key: tuple[str, int, tuple[int, ...]]  # (tenant, parent block id, tokens)
    kv: torch.Tensor  # [num_layers, 2, H_kv, block_tokens, D]: keys then values
    # [block_tokens, F] the features a hidden-state draft reads, and which layers they are (() = final)
    features: torch.Tensor | None = None
    feature_layers: tuple[int, ...] = ()
    pins: int = 0  # leases and inserts reading it now: never evicted meanwhile
    children: int = 0  # cached blocks whose parent it is: evicted only after them

    @property
    def nbytes(self) -> int:
        extra = 0 if self.features is None else self.features.nelement() * self.features.element_size()
        return self.kv.nelement() * self.kv.element_size() + extra

    def serves(self, feature_layers: tuple[int, ...] | None) -> bool:
        """Whether a session keeping these features (None = none) can start from this block."""
        return feature_layers is None or (self.features is not None and self.feature_layers == feature_layers)


@dataclass
class Lease:
    """The blocks of a cached prefix, pinned until `PrefixCache.release`."""

    blocks: list[Block] = field(default_factory=list)
    block_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_tokens

    def kv(self) -> torch.Tensor:
        """[L, 2, H_kv, n, D]: the leased positions' K/V, keys then values (a new tensor)."""
        return torch.cat([block.kv for block in self.blocks], dim=3)

    def features(self) -> torch.Tensor | None:
        """[n, F]: the leased positions' features (a new tensor); None when the blocks keep none."""
        features = [block.features for block in self.blocks]
        if not features or any(f is None for f in features):
            return None
        return torch.cat(features, dim=0)  # type: ignore[arg-type]


@dataclass(frozen=True)
class DraftPrefix:
    """Where a draft model keeps its own prompt K/V across requests: blocks of a prefix cache under a
    namespace of their own (which draft, which tenant), so the target's blocks and another draft's or
    another tenant's never meet them."""

    cache: PrefixCache
    namespace: str
    on_load: Callable[[int], None] | None = None  # told how many positions a drafter loaded (metrics)

    @classmethod
    def of(
        cls, cache: PrefixCache | None, draft: str, *scope: str, on_load: Callable[[int], None] | None = None
    ) -> DraftPrefix | None:
        """`draft`'s blocks in `cache` under `scope` (in a draft replica: the tenant, and the target whose
        state the draft reads), or None without a cache."""
        return None if cache is None else cls(cache, repr(("draft", draft, *scope)), on_load)


@dataclass
class DraftBlocks:
    """A drafter's own cache over the committed tokens, as far as it is cacheable, and where it goes.

    A drafter encodes in chunks at absolute multiples of `chunk` (as the target prefills), so positions
    [0, exact) encoded by whole chunks from the start, or loaded, are what any request with those tokens
    encodes there, bit for bit; it loads whole chunks only, also from a cache of finer blocks. Only
    positions below `limit` may be cached: a draft reading the target's state reads exact state only over
    the prompt (later positions come from verify forwards); one reading only tokens has no limit. None: not
    told, nothing is cached.
    """

    prefix: DraftPrefix | None
    chunk: int
    limit: int | None = None
    exact: int = 0

    def __post_init__(self) -> None:
        if self.prefix is not None and self.chunk % self.prefix.cache.block_tokens:
            raise InvalidArgument(
                f"a draft's prefix cache blocks ({self.prefix.cache.block_tokens} tokens) must tile its "
                f"chunk ({self.chunk})"
            )

    def namespace(self, *scope: object) -> str:
        assert self.prefix is not None
        return repr((self.prefix.namespace, *scope)) if scope else self.prefix.namespace

    def load(self, keys: Sequence[int], max_tokens: int, cache: PositionalKVCache, *scope: object) -> int:
        """Into the empty `cache`: the longest cached prefix of `keys` (each position's key token), at most
        `max_tokens` positions; returns how many."""
        if self.prefix is None or cache.length or not self.limit:
            return 0
        store = self.prefix.cache
        lease = store.acquire(self.namespace(*scope), keys, min(max_tokens, self.limit), multiple=self.chunk)
        try:
            self.exact = store.load(lease, cache)
        finally:
            store.release(lease)
        if self.exact and self.prefix.on_load is not None:
            self.prefix.on_load(self.exact)
        return self.exact

    def encoded(
        self, keys: Sequence[int], keep: int, end: int, cache: PositionalKVCache, *scope: object
    ) -> None:
        """After positions [keep, end) were encoded in chunks: fed from where the exact positions end, the
        whole chunks below `limit` are exact too and are cached; fed from elsewhere (after a rejected
        spine), the exact positions end where the kept ones do."""
        if keep == self.exact:
            exact = min(end, self.limit or 0) // self.chunk * self.chunk
        else:
            exact = min(self.exact, keep)
        if self.prefix is not None and exact > self.exact:
            self.prefix.cache.insert(self.namespace(*scope), keys[:exact], cache)
        self.exact = exact

    def reset(self) -> None:
        self.exact = 0


class BlockSource(Protocol):
    """Positions [0, length) whose K/V a prefill computed in chunks at absolute multiples of the block."""

    @property
    def length(self) -> int: ...

    def kv_block(self, start: int, end: int) -> torch.Tensor:
        """[L, 2, H_kv, end - start, D]: positions [start, end), keys then values, copied."""
        ...

    def feature_block(self, start: int, end: int) -> tuple[torch.Tensor, tuple[int, ...]] | None:
        """([end - start, F] copied, which layers they are) where the source keeps features, else None."""
        ...


class SessionBlocks:
    """A session's own cache as a block source: all layers' K/V, and its features when it keeps them."""

    def __init__(self, cache: PositionalKVCache) -> None:
        self.cache = cache

    @property
    def length(self) -> int:
        return self.cache.length

    def kv_block(self, start: int, end: int) -> torch.Tensor:
        return torch.stack(
            [
                torch.stack((la.keys[0, :, start:end], la.values[0, :, start:end]))
                for la in self.cache.positional_layers
            ]
        )  # [L, 2, H_kv, n, D]

    def feature_block(self, start: int, end: int) -> tuple[torch.Tensor, tuple[int, ...]] | None:
        buffer = self.cache.features
        if buffer is None or buffer.length < end:
            return None
        return buffer.states[0, start:end].clone(), buffer.layers  # [n, F]


@dataclass
class PrefixCacheStats:
    lookup_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of which were served from the cache
    evicted_blocks: int = 0


class PrefixCache:
    """Thread-safe: one lock guards the index; tensors are copied outside it (pinned blocks)."""

    def __init__(self, budget_bytes: int, block_tokens: int) -> None:
        if budget_bytes < 0 or block_tokens < 1:
            raise InvalidArgument("the prefix cache needs budget_bytes >= 0 and block_tokens >= 1")
        self.budget_bytes = budget_bytes
        self.block_tokens = block_tokens
        self.stats = PrefixCacheStats()
        self._lock = threading.Lock()
        self._blocks: dict[tuple[str, int, tuple[int, ...]], Block] = {}
        self._lru: OrderedDict[int, Block] = OrderedDict()  # least recently used first
        self._next_id = 0
        self.used_bytes = 0

    def __len__(self) -> int:
        return len(self._lru)

    def _blocks_of(self, token_ids: Sequence[int]) -> list[tuple[int, ...]]:
        size = self.block_tokens
        return [tuple(token_ids[i : i + size]) for i in range(0, len(token_ids) - size + 1, size)]

    def _touch(self, chain: list[Block]) -> None:
        # Leaf first, so every parent is more recent than its children and tails go before heads.
        for block in reversed(chain):
            self._lru.move_to_end(block.block_id)

    def acquire(
        self,
        tenant: str,
        token_ids: Sequence[int],
        max_tokens: int,
        feature_layers: tuple[int, ...] | None = None,
        multiple: int = 1,
    ) -> Lease:
        """Pins the longest cached prefix of `token_ids` (whole blocks, at most `max_tokens` tokens, a
        multiple of `multiple` tokens) that `tenant` inserted; `feature_layers`: the features the session
        keeps (None = none)."""
        wanted = self._blocks_of(token_ids[:max_tokens])
        lease = Lease(block_tokens=self.block_tokens)
        with self._lock:
            parent = ROOT
            for tokens in wanted:
                block = self._blocks.get((tenant, parent, tokens))
                if block is None or not block.serves(feature_layers):
                    break
                block.pins += 1
                lease.blocks.append(block)
                parent = block.block_id
            while lease.num_tokens % multiple:  # a chain ending inside a multiple: its tail is not used
                lease.blocks.pop().pins -= 1
            self._touch(lease.blocks)
            self.stats.lookup_tokens += len(token_ids)
            self.stats.hit_tokens += lease.num_tokens
        return lease

    def release(self, lease: Lease) -> None:
        with self._lock:
            for block in lease.blocks:
                block.pins -= 1
            lease.blocks = []
        self._evict_to_budget()

    @torch.inference_mode()  # the session's buffers are inference tensors (created in its forwards)
    def load(self, lease: Lease, cache: PositionalKVCache) -> int:
        """Writes the leased prefix into an empty `cache` as positions [0, n); returns n."""
        if not lease.blocks:
            return 0
        if cache.length:
            raise InvalidArgument("a cached prefix loads only into an empty cache")
        kv = lease.kv()  # [L, 2, H_kv, n, D]
        for index, layer in enumerate(cache.positional_layers):
            layer.update(kv[index, 0][None], kv[index, 1][None])  # [1, H_kv, n, D] each
        if cache.features is not None:
            features = lease.features()
            assert features is not None, "acquire matched blocks without features"
            cache.features.update(features)  # [n, F]
        return lease.num_tokens

    def insert(self, tenant: str, token_ids: Sequence[int], cache: PositionalKVCache) -> None:
        """Caches the whole blocks of `token_ids`, whose K/V `cache` holds at positions [0, len)."""
        self.insert_from(tenant, token_ids, SessionBlocks(cache))

    @torch.inference_mode()
    def insert_from(self, tenant: str, token_ids: Sequence[int], source: BlockSource) -> None:
        """Caches the whole blocks of `token_ids`, whose K/V `source` holds at positions [0, len)."""
        if self.budget_bytes == 0:
            return
        chain: list[Block] = []  # pinned while the insert runs: its parents are never evicted under it
        try:
            parent = ROOT
            for index, tokens in enumerate(self._blocks_of(token_ids[: source.length])):
                start, end = index * self.block_tokens, (index + 1) * self.block_tokens
                key = (tenant, parent, tokens)
                with self._lock:
                    block = self._blocks.get(key)
                    if block is not None:
                        block.pins += 1
                        chain.append(block)
                if block is None:
                    block = self._add(_new_block(key, source, start, end), chain)
                    if block is None:
                        return  # no room even after evicting: the rest of the chain is not cached
                elif block.features is None and (features := source.feature_block(start, end)) is not None:
                    self._attach(block, *features)  # [block, F]
                parent = block.block_id
            with self._lock:
                self._touch(chain)
        finally:
            with self._lock:
                for block in chain:
                    block.pins -= 1
            self._evict_to_budget()

    def _add(self, block: Block, chain: list[Block]) -> Block | None:
        """Indexes a new block if the budget can hold it (or takes the one another insert indexed
        meanwhile); the block is pinned and appended to `chain`. None: no room."""
        with self._lock:
            existing = self._blocks.get(block.key)
            if existing is not None:
                block = existing
            else:
                self._evict(self.budget_bytes - block.nbytes)
                if self.used_bytes + block.nbytes > self.budget_bytes:
                    return None
                block.block_id, self._next_id = self._next_id, self._next_id + 1
                if chain:
                    chain[-1].children += 1
                self._blocks[block.key] = block
                self._lru[block.block_id] = block
                self.used_bytes += block.nbytes
            block.pins += 1
            chain.append(block)
            return block

    def _attach(self, block: Block, features: torch.Tensor, layers: tuple[int, ...]) -> None:
        """Gives a cached block the features it lacked, if the budget can hold them."""
        extra = features.nelement() * features.element_size()
        with self._lock:
            if block.features is not None:
                return
            self._evict(self.budget_bytes - extra)
            if self.used_bytes + extra <= self.budget_bytes:
                block.features, block.feature_layers = features, layers
                self.used_bytes += extra

    def _evict_to_budget(self) -> None:
        with self._lock:
            self._evict(self.budget_bytes)

    def _evict(self, target_bytes: int) -> None:
        """Drops least recently used unpinned leaves until at most `target_bytes` are used. Holds the lock."""
        while self.used_bytes > target_bytes:
            victim = next((b for b in self._lru.values() if b.pins == 0 and b.children == 0), None)
            if victim is None:
                return
            del self._lru[victim.block_id]
            del self._blocks[victim.key]
            self.used_bytes -= victim.nbytes
            self.stats.evicted_blocks += 1
            parent = victim.key[1]
            if parent != ROOT:
                self._lru[parent].children -= 1


def _new_block(key: tuple[str, int, tuple[int, ...]], source: BlockSource, start: int, end: int) -> Block:
    """A block of the source's positions [start, end): its K/V (and features, when the source keeps them
    there), copied."""
    block = Block(-1, key, source.kv_block(start, end))  # kv: [L, 2, H_kv, block_tokens, D]
    features = source.feature_block(start, end)
    if features is not None:
        block.features, block.feature_layers = features  # [block_tokens, F]
    return block
