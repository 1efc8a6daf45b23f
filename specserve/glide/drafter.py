"""GlideDrafter: a GliDe draft that reads the target's committed KV cache in place.

Per round (root = the newest committed token, at position L; the target cache holds positions < L):
1. sync: the draft's own cache keeps the committed tokens it already encoded (common prefix, never the
   root), then encodes the rest of the committed tokens and the root. Committed tokens are encoded with
   training's block-wise cross mask, so the cache depends on the sequence alone and matches training;
   the root sees all L target positions.
2. draft a spine of up to `depth` tokens greedily (or sampled at T > 0 for chains); each cross-attends
   to the same L positions: the target cache is stale by 1..depth tokens for them, as in training, and
   nothing is recomputed. The shape's stop policy may end the spine sooner (SVIP on top of GliDe+CaPE).
3. with CaPE, each depth also gets top-k leaves beside the spine token, k chosen by the draft's
   confidence (core/cape.py); the candidates are fixed, so the verifier needs no q. The depth where a
   stop policy ends the spine keeps its leaves.
The root and spine tokens' draft KV is dropped next round, which re-encodes [root, accepted..., bonus]
(the official scheme).

The sync encodes in chunks at absolute multiples of `prefill_chunk`, as the target prefills, and a chunk
without the root cross-attends only the target positions its rows may see (its last row's trained
length), so its shapes depend on its positions alone: whole chunks over the prompt (whose target K/V the
target prefilled) are what any request with those tokens encodes there, bit for bit. With a `prefix`
they are kept across requests and a request starts from them (runtime/prefix_cache.py, DraftBlocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from specserve.core.cape import CapeSettings
from specserve.core.protocols import READS_NOTHING, DraftTree, TargetReads
from specserve.core.sampling_params import GREEDY, SamplingParams
from specserve.errors import FailedPrecondition
from specserve.glide.batch import GlideSegment, glide_batcher
from specserve.glide.model import (
    GlideDraft,
    TargetKV,
    cross_mask_from_lengths,
    per_block,
    trained_cross_lengths,
)
from specserve.runtime.batching import batched_call
from specserve.runtime.drafter import DraftShape, WidthDrafter, chunk_bounds, common_prefix_length, spine_cap
from specserve.runtime.kv_cache import PositionalKVCache
from specserve.runtime.prefix_cache import DraftBlocks, DraftPrefix
from specserve.runtime.target import DEFAULT_PREFILL_CHUNK


class TargetKVSource(Protocol):
    """Read-only view of the target's committed KV; `PositionalKVCache` satisfies it."""

    def layer_kv(self, layer_idx: int) -> TargetKV:
        """Committed K/V of one layer, as views (no copy): every committed token but the root."""
        ...


class GlideDrafter(WidthDrafter):
    def __init__(
        self,
        model: GlideDraft,
        target_kv: TargetKVSource,
        capacity: int,
        shape: DraftShape | None = None,
        cape: CapeSettings | None = None,
        sampling: SamplingParams = GREEDY,
        prefix: DraftPrefix | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    ) -> None:
        """shape: depth, and fixed widths for non-CaPE trees (default: a chain of 4); cape: widths by
        confidence instead (then shape.widths must be empty; CaPE's candidates are fixed); prefix: where
        its own K/V over the prompt are kept across requests (blocks of `prefill_chunk`)."""
        super().__init__(shape or DraftShape(depth=4), cape, sampling, model.config.head_vocab_size)
        self.model = model
        self.target_kv = target_kv
        # Cacheable: positions over the prompt (`know_prompt`), whose target K/V the target prefilled.
        self.blocks = DraftBlocks(prefix, prefill_chunk)
        # The block without cross-attention (the vanilla methods' trained draft) reads no target state.
        reads_kv = model.config.cross_attention
        self.reads = TargetReads(kv_layers=tuple(model.config.feed_layers)) if reads_kv else READS_NOTHING
        self.device = next(model.parameters()).device
        self.cache = PositionalKVCache(model.config.num_layers, capacity)  # the draft's self-attention KV
        self._cached_ids: list[int] = []  # committed tokens (never the root) whose KV `cache` holds

    def _read_target_kv(self) -> list[TargetKV]:
        """Each block's target layer's K/V; nothing read for a block without cross-attention (empty)."""
        layers = self.model.config.layers_read
        if self.reads.anything:
            return [self.target_kv.layer_kv(layer) for layer in layers]
        empty = torch.zeros((1, 1, 0, 1), device=self.device)
        return [(empty, empty)] * len(layers)

    @torch.inference_mode()
    def _draft(self, token_ids: Sequence[int], generator: torch.Generator) -> DraftTree:
        root_position = len(token_ids) - 1
        max_depth = spine_cap(self.shape.depth, self.stop_policy)  # the cap grow_spine_tree applies
        if max_depth == 0:
            # Nothing is worth drafting this round (the batch-aware cost policy under load): no forward
            # and no target KV read (a draft service need not have it); the draft cache catches up on
            # the next round that drafts.
            return DraftTree.root_only(token_ids[-1])
        # per block, views: [1, Hkv, L, D]
        target_kv = self._read_target_kv()
        if self.reads.anything and target_kv[0][0].shape[2] != root_position:
            raise FailedPrecondition(
                f"the target cache holds {target_kv[0][0].shape[2]} positions; the draft needs the "
                f"{root_position} committed tokens before the root"
            )
        logits = self._sync(token_ids, target_kv)  # [V] after the root

        def advance(spine_token: int, depth_index: int) -> torch.Tensor:
            return self._forward([spine_token], root_position + 1 + depth_index, None, target_kv)

        def width_at(depth_index: int, logits: torch.Tensor, num_nodes: int) -> int:
            return self._width(depth_index, logits, num_nodes, max_depth)

        return self._grow(token_ids, logits, width_at, advance, generator)

    def _sync(self, token_ids: Sequence[int], target_kv: Sequence[TargetKV]) -> torch.Tensor:
        """Encodes the committed tokens the cache lacks and the root, in chunks; returns the logits after
        the root."""
        root_position = len(token_ids) - 1
        if not self._cached_ids:  # the cached prefix, never the root (it sees every target position)
            self._cached_ids = list(token_ids[: self.blocks.load(token_ids, root_position, self.cache)])
        keep = common_prefix_length(self._cached_ids, token_ids[:root_position])
        self.cache.truncate(keep)  # also drops last round's root and spine tokens
        del self._cached_ids[keep:]
        logits = torch.empty(0)
        blocks = per_block(target_kv, len(self.model.config.layers_read))  # one target layer each
        for start, end in chunk_bounds(keep, root_position + 1, self.blocks.chunk):
            mask, seen = self._chunk_cross_mask(start, end, root_position)
            read = [_first_positions(k, v, seen) for k, v in blocks]  # [1, Hkv_t, seen, Dt] each
            logits = self._forward(token_ids[start:end], start, mask, read)
        self._cached_ids.extend(token_ids[keep:root_position])
        self.blocks.encoded(self._cached_ids, keep, root_position, self.cache)
        return logits

    def _chunk_cross_mask(self, start: int, end: int, root_position: int) -> tuple[torch.Tensor, int]:
        """Positions [start, end)'s cross mask over the target positions they read, and how many those
        are: the root sees every committed one; any other row training's block-wise prefix, so a chunk
        without the root reads only up to its last row's (the same columns in any request)."""
        positions = torch.arange(start, end, device=self.device)  # [n]
        visible = trained_cross_lengths(positions, self.model.config.block_size)  # [n]
        if end == root_position + 1:
            visible[-1] = root_position
            seen = root_position
        else:
            seen = int(visible[-1]) if self.reads.anything else root_position
        return cross_mask_from_lengths(visible, seen), seen  # [n, seen]

    def know_prompt(self, num_tokens: int) -> None:
        """The request's prompt is its first `num_tokens` tokens (core/protocols.py, KnowsPrompt)."""
        self.blocks.limit = num_tokens

    def _forward(
        self,
        token_ids: Sequence[int],
        start: int,  # absolute position of token_ids[0]; the cache holds exactly positions < start
        cross_mask: torch.Tensor | None,  # [n, L] bool; None = every target position
        target_kv: Sequence[TargetKV],  # per block
    ) -> torch.Tensor:
        """Appends `token_ids` to the draft cache; returns full-vocabulary logits after the last, [V]."""
        assert self.cache.length == start, "the draft cache must end right before `token_ids`"
        segment = GlideSegment(self.cache, list(token_ids), start, cross_mask, target_kv)
        return batched_call(glide_batcher(self.model), segment)

    def release(self) -> None:
        """Ends the request: the cache and the pending round go; the policy's learning stays."""
        self.cache.truncate(0)
        self._cached_ids.clear()
        self.blocks.reset()
        self.blocks.limit = None
        self._feedback.reset()


def _first_positions(keys: torch.Tensor, values: torch.Tensor, n: int) -> TargetKV:
    """Views of the first n positions (the tensors themselves when that is all of them: not even an alias)."""
    if n == keys.shape[2]:
        return keys, values
    return keys[:, :, :n], values[:, :, :n]
