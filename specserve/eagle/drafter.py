"""EagleDrafter: a hidden-state draft reading the target's committed final hidden states.

Per round (root = the newest committed token x[L]; the target holds features h[0..L-1]):
1. sync: the draft's cache keeps the positions it already encoded from the target's features (those whose
   next token still matches), then encodes the rest, position t reading (h[t], x[t + 1]); the last, t =
   L - 1, reads the root and predicts the first draft token.
2. draft a spine: the token drafted at depth d sits at position L + d and reads the draft's own output
   at the position before it (what training's unrolled steps taught it). The stop policy and CaPE widths
   work as for GliDe (specserve/glide/drafter.py); only the spine carries on, leaves stay leaves.
Drafted positions are dropped next round, which re-encodes from the target's features.

The sync encodes in chunks at absolute multiples of `prefill_chunk`, as the target prefills, so positions
encoded by whole chunks from the start over prompt features (which the target computed by prefill
chunks) are what any request with those tokens encodes there, bit for bit. With a `prefix`, they are
kept across requests, and a request starts from the longest cached prefix: its drafts are the cold ones.
Position t's K/V depend on x[0..t + 1] (h[t] on x[0..t], and x[t + 1] itself): blocks are keyed by the
next tokens x[1..] under a namespace holding x[0].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specserve.core.cape import CapeSettings
from specserve.core.protocols import DraftTree, TargetReads
from specserve.core.sampling_params import GREEDY, SamplingParams
from specserve.eagle.model import EagleDraft
from specserve.errors import FailedPrecondition
from specserve.runtime.batching import batched_call, shared_batcher
from specserve.runtime.drafter import DraftShape, WidthDrafter, chunk_bounds, common_prefix_length, spine_cap
from specserve.runtime.kv_cache import PositionalKVCache
from specserve.runtime.prefix_cache import DraftBlocks, DraftPrefix
from specserve.runtime.target import DEFAULT_PREFILL_CHUNK


class HiddenStateSource(Protocol):
    """Read-only view of the target's committed final hidden states; `PositionalKVCache` (after
    `keep_features`) and the draft service's feed mirror satisfy it."""

    def keep_features(self, layers: Sequence[int] = ()) -> None:
        """Asks for features from now on: the final hidden states, or the outputs of decoder `layers`
        side by side (the target's cache starts storing them; the feed mirror subscribes to them)."""
        ...

    def hidden_states(self) -> torch.Tensor:
        """[1, L, F]: every committed position but the root's, as a view."""
        ...


@dataclass(frozen=True)
class EagleSegment:
    """One session's draft forward: positions start.. appended to its draft cache."""

    cache: PositionalKVCache  # holds exactly the positions before `start`
    features: torch.Tensor  # [1, n, H]
    token_ids: Sequence[int]  # [n], the token after each feature
    start: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class EagleBatcher:
    """The batched form of one EagleDraft: (predicted feature [H], logits [V]) after each segment's last
    position. The layer runs per segment (each its own cache); the LM head once over all of them."""

    label = "draft"
    priority = -1  # draft forwards run before target forwards (runtime/batching.py)

    def __init__(self, model: EagleDraft) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    @torch.inference_mode()
    def forward_batch(self, segments: Sequence[EagleSegment]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        last = []
        for segment in segments:
            n = segment.num_tokens
            ids = torch.tensor([list(segment.token_ids)], device=self.device)  # [1, n]
            positions = torch.arange(segment.start, segment.start + n, device=self.device)  # [n]
            features = segment.features.to(device=self.device, dtype=self.dtype)  # [1, n, H]
            last.append(self.model(features, ids, positions, segment.cache)[0, -1])  # [H]
        states = torch.stack(last)  # [B, H]
        logits = self.model.logits(states).float()  # [B, V]
        return list(zip(states.unbind(0), logits.unbind(0), strict=True))


def eagle_batcher(model: EagleDraft) -> EagleBatcher:
    """The one batcher of `model` (runtime/batching.py `shared_batcher`)."""
    return shared_batcher(model, EagleBatcher)


class EagleDrafter(WidthDrafter):
    def __init__(
        self,
        model: EagleDraft,
        source: HiddenStateSource,
        capacity: int,
        shape: DraftShape | None = None,
        cape: CapeSettings | None = None,
        sampling: SamplingParams = GREEDY,
        prefix: DraftPrefix | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    ) -> None:
        """shape: depth, and fixed widths for non-CaPE trees (default: a chain of 4); cape: widths by
        confidence instead (then shape.widths must be empty); prefix: where its own prompt K/V are kept
        across requests (blocks of `prefill_chunk`)."""
        super().__init__(shape or DraftShape(depth=4), cape, sampling, model.config.head_vocab_size)
        # Cacheable: positions over the prompt's features (`know_prompt`), which the target prefilled.
        self.blocks = DraftBlocks(prefix, prefill_chunk)
        self.model = model
        self.source = source
        self.reads = TargetReads(hidden_states=True, feature_layers=tuple(model.config.feature_layers))
        source.keep_features(model.config.feature_layers)
        self.cache = PositionalKVCache(1, capacity + 1)  # the draft's own KV (room for the drafted spine)
        self._cached_ids: list[int] = []  # x[t + 1] of each position the cache holds from target features
        self._state = torch.empty(0)  # the draft's output at the newest position it encoded, [H]

    @torch.inference_mode()
    def _draft(self, token_ids: Sequence[int], generator: torch.Generator) -> DraftTree:
        root_position = len(token_ids) - 1
        max_depth = spine_cap(self.shape.depth, self.stop_policy)
        if max_depth == 0 or root_position == 0:  # nothing worth drafting, or no feature to read yet
            return DraftTree.root_only(token_ids[-1])
        features = self.source.hidden_states()  # [1, L, F]
        if features.shape[2] != self.model.config.feature_width and features.shape[1]:
            raise FailedPrecondition(
                f"the target sends features {features.shape[2]} wide; this draft reads "
                f"{self.model.config.feature_width} (target layers {list(self.model.config.feature_layers)}"
                " side by side, or its final hidden state): serve both with the same hidden-state draft"
            )
        if features.shape[1] != root_position:
            raise FailedPrecondition(
                f"the target holds hidden states of {features.shape[1]} positions; the draft needs the "
                f"{root_position} committed tokens before the root"
            )
        logits = self._sync(token_ids, features)  # [V] after the root

        def advance(spine_token: int, depth_index: int) -> torch.Tensor:
            return self._forward(self._state[None, None], [spine_token], root_position + depth_index)

        def width_at(depth_index: int, logits: torch.Tensor, num_nodes: int) -> int:
            return self._width(depth_index, logits, num_nodes, max_depth)

        return self._grow(token_ids, logits, width_at, advance, generator)

    def _sync(self, token_ids: Sequence[int], features: torch.Tensor) -> torch.Tensor:
        """Encodes the committed positions the cache lacks (always the root's pair, t = L - 1), in chunks
        at absolute multiples of the prefill chunk; whole chunks over prompt features are offered to the
        prefix cache."""
        root_position = len(token_ids) - 1
        nexts = token_ids[1:]  # x[t + 1] for t = 0 .. L - 1
        if not self._cached_ids:  # the cached prefix, leaving the root's pair to encode (its output drafts)
            self._cached_ids = list(
                nexts[: self.blocks.load(nexts, root_position - 1, self.cache, token_ids[0])]
            )
        keep = min(common_prefix_length(self._cached_ids, nexts), root_position - 1)
        self.cache.truncate(keep)  # also drops last round's drafted positions
        del self._cached_ids[keep:]
        logits = torch.empty(0)
        for start, end in chunk_bounds(keep, root_position, self.blocks.chunk):
            logits = self._forward(self.model.lift(features[:, start:end]), nexts[start:end], start)
        self._cached_ids.extend(nexts[keep:])
        # x[0]: the blocks' keys start at x[1]
        self.blocks.encoded(self._cached_ids, keep, root_position, self.cache, token_ids[0])
        return logits

    def know_prompt(self, num_tokens: int) -> None:
        """The request's prompt is its first `num_tokens` tokens (core/protocols.py, KnowsPrompt)."""
        self.blocks.limit = num_tokens

    def _forward(self, features: torch.Tensor, token_ids: Sequence[int], start: int) -> torch.Tensor:
        """Appends positions start.. to the draft cache; keeps the last predicted feature; returns the
        full-vocabulary logits after it, [V]."""
        assert self.cache.length == start, "the draft cache must end right before `start`"
        segment = EagleSegment(self.cache, features=features, token_ids=list(token_ids), start=start)
        self._state, logits = batched_call(eagle_batcher(self.model), segment)
        return logits

    def release(self) -> None:
        """Ends the request: the cache and the pending round go; the policy's learning stays."""
        self.cache.truncate(0)
        self._cached_ids.clear()
        self.blocks.reset()
        self.blocks.limit = None
        self._feedback.reset()
