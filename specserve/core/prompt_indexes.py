"""Suffix indexes of prompts kept across requests: a session indexes only what its tenant has not sent.

A chat client re-sends the conversation each turn, an agent its tools and history, a RAG app one
document under each question. A session's suffix index (core/suffix.py) then starts from the longest
block-aligned prefix of its prompt that an earlier prompt of the same tenant indexed, and indexes only
the tokens after it: the index is the same as one built from nothing (a test compares them), so the
proposals, and the tokens a seeded sampled session draws, do not depend on the cache.

Entries are keyed by (tenant, match lengths, a digest chain over the prompt's whole blocks), like the
targets' prefix caches, and their tokens are compared before use. A prompt is stored up to its last
whole block as the earlier prefix plus one new frozen span, so a conversation's turns share their spans;
a chain longer than `max_spans` is indexed again as one span (its lookups would slow every round). The
distinct spans held are bounded by `max_tokens`, least recently used prompts going first; a session in
flight keeps reading the spans it started from, evicted or not. A tenant's prompts serve only that
tenant. Pure Python, thread-safe: the router, which has no torch, keeps one for all its sessions.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specserve.core.suffix import IndexedPrefix, IndexedSpan, SuffixIndex
from specserve.errors import InvalidArgument

PROMPT_INDEX_TOKENS = 32768  # a cache's default bound (about 1.4 KB a token: ~47 MB)
BLOCK_TOKENS = 64  # prompts are cached up to their last whole block of this many tokens
MAX_SPANS = 16  # spans a cached prompt may chain before it is indexed again as one


def block_digests(tenant: str, token_ids: Sequence[int], block_tokens: int, num_blocks: int) -> list[bytes]:
    """One digest per leading whole block: each covers the tenant and every token up to the block's
    end, so equal digests mean equal prefixes of one tenant."""
    digest = hashlib.blake2b(tenant.encode(), digest_size=16)
    out = []
    for start in range(0, num_blocks * block_tokens, block_tokens):
        digest.update(struct.pack(f"<{block_tokens}I", *token_ids[start : start + block_tokens]))
        out.append(digest.copy().digest())
    return out


_Key = tuple[str, int, int, bytes]  # (tenant, min_match, max_match, digest of the prompt's blocks)


@dataclass(frozen=True)
class TenantPrompts:
    """The prompt index cache and the tenant whose prompts a session may start from."""

    cache: PromptIndexCache
    tenant: str


@dataclass(eq=False)
class _Prompt:
    prefix: IndexedPrefix  # up to the prompt's last whole block
    keys: list[_Key]  # its blocks' keys (those still naming it lead here)


class PromptIndexCache:
    """Prompts' suffix indexes in frozen spans, per tenant (the module's docstring); thread-safe."""

    def __init__(
        self,
        max_tokens: int,
        block_tokens: int = BLOCK_TOKENS,
        max_spans: int = MAX_SPANS,
        on_start: Callable[[int, int], None] | None = None,
    ) -> None:
        """`on_start(reused, indexed)`: per session started, its prompt tokens read from the cache and
        those indexed for it (metrics)."""
        if max_tokens < 1 or block_tokens < 1 or max_spans < 1:
            raise InvalidArgument("max_tokens, block_tokens and max_spans must be >= 1")
        self.max_tokens = max_tokens
        self.block_tokens = block_tokens
        self.max_spans = max_spans
        self._on_start = on_start
        self._prompts: OrderedDict[_Prompt, None] = OrderedDict()  # least recently used first
        self._blocks: dict[_Key, tuple[_Prompt, int]] = {}  # key -> (prompt, its length)
        self._held: dict[int, tuple[IndexedSpan, int]] = {}  # id(span) -> (span, prompts holding it)
        self._held_tokens = 0
        self._lock = threading.Lock()

    @property
    def held_tokens(self) -> int:
        """Tokens of the distinct spans held (at most max_tokens)."""
        with self._lock:
            return self._held_tokens

    def __len__(self) -> int:
        """Prompts held."""
        with self._lock:
            return len(self._prompts)

    def start(self, index: SuffixIndex, tenant: str, token_ids: Sequence[int]) -> int:
        """Indexes `token_ids` into the empty `index`, from `tenant`'s longest cached prefix of them, and
        caches them up to their last whole block. Returns the tokens read from the cache."""
        if len(token_ids) > index.max_tokens:  # the index keeps a window of the stream, no prefix
            index.extend(token_ids)
            return 0
        blocks = len(token_ids) // self.block_tokens
        digests = block_digests(tenant, token_ids, self.block_tokens, blocks)
        keys = [(tenant, index.min_match, index.max_match, d) for d in digests]
        empty = IndexedPrefix.empty(index.min_match, index.max_match)
        prefix = self._longest(keys, token_ids) or empty
        if prefix.length < blocks * self.block_tokens and len(prefix.spans) >= self.max_spans:
            prefix = empty  # a chain this long is indexed again as one span
        reused = prefix.length
        if reused < blocks * self.block_tokens:
            prefix = prefix.extended(token_ids, blocks * self.block_tokens)
            self._store(_Prompt(prefix, keys))
        index.extend_from(prefix, token_ids)
        if self._on_start is not None:
            self._on_start(reused, len(token_ids) - reused)
        return reused

    def _longest(self, keys: Sequence[_Key], token_ids: Sequence[int]) -> IndexedPrefix | None:
        with self._lock:
            for key in reversed(keys):
                hit = self._blocks.get(key)
                if hit is None:
                    continue
                prompt, length = hit
                prefix = prompt.prefix.cut(length)
                if prefix.matches(token_ids):  # digests do not collide in practice: tokens decide
                    self._prompts.move_to_end(prompt)
                    return prefix
        return None

    def _store(self, prompt: _Prompt) -> None:
        with self._lock:
            self._prompts[prompt] = None
            for i, key in enumerate(prompt.keys):
                self._blocks[key] = (prompt, (i + 1) * self.block_tokens)
            for span in prompt.prefix.spans:
                held, count = self._held.get(id(span), (span, 0))
                self._held[id(span)] = (held, count + 1)
                self._held_tokens += len(span.tokens) if count == 0 else 0
            while self._held_tokens > self.max_tokens and self._prompts:
                evicted, _ = self._prompts.popitem(last=False)
                self._release(evicted)

    def _release(self, prompt: _Prompt) -> None:
        for key in prompt.keys:
            if self._blocks.get(key, (None,))[0] is prompt:
                del self._blocks[key]
        for span in prompt.prefix.spans:
            held, count = self._held[id(span)]
            if count == 1:
                del self._held[id(span)]
                self._held_tokens -= len(span.tokens)
            else:
                self._held[id(span)] = (held, count - 1)
