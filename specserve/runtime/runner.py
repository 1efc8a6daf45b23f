"""One forward of a Hugging Face causal LM over a chain or a token tree, against a positional cache."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from specserve.core.tree import tree_depths
from specserve.core.tree_mask import tree_attention_mask
from specserve.runtime.kv_cache import PositionalKVCache


class ModelRunner:
    """Owns a model (weights only); sessions own caches. Safe to share across sessions of one thread."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.num_layers: int = model.config.num_hidden_layers
        self.vocab_size: int = model.config.vocab_size

    def new_cache(self, capacity: int) -> PositionalKVCache:
        return PositionalKVCache(self.num_layers, capacity)

    @torch.inference_mode()
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
        input_ids = torch.tensor([list(token_ids)], device=self.device)  # [1, n]
        if parent_ids is None:
            positions = torch.arange(prefix, prefix + n, device=self.device)
            mask = None  # the model builds its own causal mask from the cache's sizes
        else:
            positions = prefix + torch.tensor(tree_depths(parent_ids), device=self.device)
            tree = tree_attention_mask(parent_ids, self.device)  # [n, n]
            seen = torch.ones(n, prefix, dtype=torch.bool, device=self.device)  # [n, prefix]
            mask = torch.cat([seen, tree], dim=1)[None, None]  # [1, 1, n, prefix + n]
        return self._run(cache, input_ids, positions, mask, last_only)

    @torch.inference_mode()
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
        input_ids = torch.tensor([list(token_ids)], device=self.device)  # [1, n]
        return self._run(
            cache, input_ids, positions.to(self.device), attend.to(self.device)[None, None], False
        )

    def _run(
        self,
        cache: PositionalKVCache,
        input_ids: torch.Tensor,  # [1, n]
        positions: torch.Tensor,  # [n]
        mask: torch.Tensor | None,  # [1, 1, n, cache.length + n] or None (causal)
        last_only: bool,
    ) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions[None],  # [1, n]
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
        )
        logits = out.logits[0].float()  # [n or 1, V]
        return logits[-1] if last_only else logits
