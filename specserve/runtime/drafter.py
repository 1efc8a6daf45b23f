"""A drafter backed by any smaller causal LM sharing the target's tokenizer.

It drafts a spine of `depth` tokens autoregressively; at each depth it may add extra candidates as
leaves beside the spine token (nothing is drafted under them), which turns the chain into a tree.
At T == 0 candidates are the draft's top-w (fixed); at T > 0 they are drawn from the draft's
processed distribution q (sampled, with or without replacement) or taken as its top-w (fixed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specserve.core.protocols import DraftTree
from specserve.core.rng import make_generator
from specserve.core.sampling import logits_to_probs
from specserve.core.sampling_params import SamplingParams
from specserve.core.tree import TokenTree
from specserve.core.verify import CandidateKind
from specserve.errors import InvalidArgument
from specserve.runtime.kv_cache import PositionalKVCache
from specserve.runtime.runner import ModelRunner


@dataclass(frozen=True)
class DraftShape:
    depth: int = 4  # spine tokens drafted per round
    widths: tuple[int, ...] = ()  # candidates at each depth (spine token included); missing = 1
    sampled_kind: CandidateKind = CandidateKind.SAMPLED  # candidate rule at T > 0

    def __post_init__(self) -> None:
        if self.depth < 0 or any(w < 1 for w in self.widths) or len(self.widths) > self.depth:
            raise InvalidArgument(f"invalid draft shape {self}")

    def width(self, depth_index: int) -> int:
        return self.widths[depth_index] if depth_index < len(self.widths) else 1

    @property
    def max_nodes(self) -> int:
        return 1 + sum(self.width(d) for d in range(self.depth))


class ModelDrafter:
    def __init__(self, runner: ModelRunner, capacity: int, shape: DraftShape) -> None:
        self.runner = runner
        self.shape = shape
        self.cache: PositionalKVCache = runner.new_cache(capacity)
        self._cached_ids: list[int] = []  # tokens whose KV the draft cache holds, in order

    def propose(self, token_ids: Sequence[int], params: SamplingParams, seed: int) -> DraftTree:
        kind = CandidateKind.FIXED if params.greedy else self.shape.sampled_kind
        generator = make_generator(seed)
        logits = self._sync(token_ids)  # [V] draft logits after the root

        def advance(spine_token: int, depth_index: int) -> torch.Tensor:
            self._cached_ids.append(spine_token)
            return self.runner.forward(self.cache, [spine_token], last_only=True)

        return grow_spine_tree(
            token_ids[-1],
            logits,
            self.shape.depth,
            lambda d, _logits, _n: self.shape.width(d),
            advance,
            params,
            kind,
            generator,
        )

    def _sync(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Keeps the cached KV that still matches the committed tokens, feeds the rest (root included)."""
        keep = common_prefix_length(self._cached_ids, token_ids[:-1])
        self.cache.truncate(keep)
        del self._cached_ids[keep:]
        feed = list(token_ids[keep:])
        self._cached_ids.extend(feed)
        return self.runner.forward(self.cache, feed, last_only=True)

    def release(self) -> None:
        self.cache.truncate(0)
        self._cached_ids.clear()


def grow_spine_tree(
    root_token: int,
    logits: torch.Tensor,  # [V] draft logits after the root
    depth: int,
    width_at: Callable[[int, torch.Tensor, int], int],  # (depth index, logits, nodes so far) -> width
    advance: Callable[[int, int], torch.Tensor],  # (spine token, depth index) -> logits after it [V]
    params: SamplingParams,
    kind: CandidateKind,
    generator: torch.Generator,
) -> DraftTree:
    """Drafts a spine of `depth` tokens; each depth's extra candidates hang beside the spine token as
    leaves. A width of 0 ends the spine early. Shared by every autoregressive drafter."""
    nodes, parents = [root_token], [-1]
    draft_probs: dict[int, torch.Tensor] = {}
    parent = 0
    for d in range(depth):
        width = width_at(d, logits, len(nodes))
        if width == 0:
            break
        candidates, q = pick_candidates(logits, params, kind, width, generator)
        if q is not None:
            draft_probs[parent] = q
        spine = len(nodes)
        nodes.extend(candidates)
        parents.extend([parent] * len(candidates))
        if d + 1 == depth:
            break
        logits = advance(nodes[spine], d)
        parent = spine
    return DraftTree(TokenTree(tuple(nodes), tuple(parents)), kind, draft_probs)


def common_prefix_length(cached_ids: Sequence[int], token_ids: Sequence[int]) -> int:
    """How many leading tokens a draft cache can keep: those equal to the committed sequence."""
    keep, limit = 0, min(len(cached_ids), len(token_ids))
    while keep < limit and cached_ids[keep] == token_ids[keep]:
        keep += 1
    return keep


def pick_candidates(
    logits: torch.Tensor,  # [V]
    params: SamplingParams,
    kind: CandidateKind,
    width: int,
    generator: torch.Generator,
) -> tuple[list[int], torch.Tensor | None]:
    """Returns the candidate tokens (spine first) and q when the verifier needs it (sampled kinds)."""
    if params.greedy:
        return torch.topk(logits, width).indices.tolist(), None
    # On the CPU, like the verifier: seeded generators are CPU generators, and q is compared with p there.
    q = logits_to_probs(logits.cpu(), params)  # [V]
    width = min(width, int((q > 0).sum()))
    if kind is CandidateKind.FIXED:
        return torch.topk(q, width).indices.tolist(), None
    with_replacement = kind is CandidateKind.SAMPLED
    return torch.multinomial(q, width, replacement=with_replacement, generator=generator).tolist(), q
