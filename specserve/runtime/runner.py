"""One forward of a Hugging Face causal LM over a chain or a token tree, against a positional cache."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from specserve.core.tree import tree_depths
from specserve.core.tree_mask import tree_attention_mask
from specserve.runtime.batching import batched_call
from specserve.runtime.decoder import NativeDecoder, supports_native_forward
from specserve.runtime.kv_cache import PositionalKVCache
from specserve.runtime.ragged import forward_ragged, use_ragged_attention
from specserve.runtime.segment import Segment

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns a model (weights only); sessions own caches. Safe to share across sessions of one thread.

    Every forward is a `Segment` of one session; inside a batching job (runtime/batching.py) segments of
    concurrent sessions run as one ragged forward (runtime/ragged.py), otherwise alone.

    On a CPU a model belongs on the thread that loaded it. OpenMP gives every thread that runs a parallel
    region a team of worker threads for as long as it lives, and once libgomp manages more threads than
    there are cores it cuts its spin-wait between regions to almost nothing: every one of a forward's
    hundreds of regions then pays a sleep and a wake-up. On 2 cores a one-token step of the default model
    took 9.92 ms with two teams against 4.64 ms with one (docs/benchmarks.md, "Why every service runs its
    tensor work on one thread"). The services load and run on one model thread
    (serving/model_thread.py); a forward on another thread while the loading one lives is logged once.
    """

    def __init__(self, model: PreTrainedModel, label: str = "model") -> None:
        self.model = model
        self.label = label  # names its forwards in batching statistics
        self.priority = -1 if label == "draft" else 0  # drafts go first (runtime/batching.py)
        use_ragged_attention(model)
        # The lean forward where the architecture has one (runtime/decoder.py); transformers' otherwise.
        self.native = NativeDecoder(model) if supports_native_forward(model) else None
        self.device = next(model.parameters()).device
        self.num_layers: int = model.config.num_hidden_layers
        self.vocab_size: int = model.config.vocab_size
        self._home = threading.current_thread()  # where the model was loaded (class doc)
        self._watch_thread = self.device.type == "cpu"  # until it has warned once (OpenMP: a CPU's concern)

    @property
    def rows_independent(self) -> bool:
        """Whether every row of a forward computes the same bits whatever rows share the forward: the
        compiled layers on the CPU's kernels (runtime/fused_layers.py), where each step between the
        per-row products is per row and attention reads each row alone. Then a prefill's K/V do not
        depend on how the prompt was cut into chunks (runtime/prefix_cache.py)."""
        return self.native is not None and self.native.fused is not None

    def new_cache(self, capacity: int) -> PositionalKVCache:
        return PositionalKVCache(self.num_layers, capacity)

    def forward_batch(self, segments: Sequence[Segment]) -> list[torch.Tensor]:
        if self._watch_thread:
            self._check_thread()
        return forward_ragged(self.model, segments, self.native)

    def _check_thread(self) -> None:
        """Logs, once, a forward on another thread than the live one that loaded the model (class doc)."""
        current = threading.current_thread()
        if current is self._home or not self._home.is_alive():
            return
        self._watch_thread = False
        logger.warning(
            "the %s was loaded on thread %r and runs a forward on thread %r: with two threads running its "
            "CPU work, OpenMP's workers all but stop spinning and forwards run about twice as long; load "
            "and run a model on one thread (specserve.serving.model_thread.ModelThread does)",
            self.label,
            self._home.name,
            current.name,
        )

    def forward(
        self,
        cache: PositionalKVCache,
        token_ids: Sequence[int],
        parent_ids: Sequence[int] | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Appends `token_ids` after the cache's committed positions; returns logits [n, V] (or [V]).

        parent_ids None means a chain (causal). Otherwise the tokens form a tree: each node attends the
        whole committed prefix plus its ancestors, at position prefix_length + depth.
        """
        prefix = cache.length
        n = len(token_ids)
        if parent_ids is None:
            positions = torch.arange(prefix, prefix + n, device=self.device)  # [n]
            attend = None  # causal
        else:
            positions = prefix + torch.tensor(tree_depths(parent_ids), device=self.device)  # [n]
            tree = tree_attention_mask(parent_ids, self.device)  # [n, n]
            seen = torch.ones(n, prefix, dtype=torch.bool, device=self.device)  # [n, prefix]
            attend = torch.cat([seen, tree], dim=1)  # [n, prefix + n]
        return batched_call(self, Segment(cache, list(token_ids), positions, attend, last_only))

    def forward_masked(
        self,
        cache: PositionalKVCache,
        token_ids: Sequence[int],
        positions: torch.Tensor,  # [n] position ids
        attend: torch.Tensor,  # [n, cache.length + n] bool, True = may attend that cache slot
    ) -> torch.Tensor:
        """Appends `token_ids` with an explicit mask over every cache slot; returns logits [n, V].

        For trees grown level by level (MCSD): earlier levels already sit in the cache, and each new node
        may see only the committed prefix and its own ancestors among them.
        """
        segment = Segment(cache, list(token_ids), positions.to(self.device), attend.to(self.device))
        return batched_call(self, segment)
