"""One forward of a Hugging Face causal LM over a ragged batch: many sessions, each its own cache.

Every session's new tokens (a chain, a token tree, a prefill chunk) are packed into one sequence, so the
linear layers, which dominate the cost of a small model, run once over all of them. Attention is the
only per-session step: each session's queries attend its own cache (by absolute position, as in
`PositionalKVCache`) under its own mask. It plugs into the model through transformers' attention
registry (`ATTENTION_NAME`), which is handed the forward's `ForwardBatch`; a forward without one
(transformers `generate`, training) runs plain SDPA, so one model serves both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specserve.runtime.decoder import NativeDecoder
from specserve.runtime.layer_outputs import capture_layer_outputs, side_by_side
from specserve.runtime.segment import ForwardBatch, Segment

ATTENTION_NAME = "specserve_ragged"
BATCH_KWARG = "specserve_forward_batch"


class _RaggedLayer(CacheLayerMixin):
    """Writes each segment's slice of the packed K/V into that session's own cache layer."""

    is_compileable = False

    def __init__(self, batch: ForwardBatch, layer_idx: int) -> None:
        super().__init__()
        self.batch, self.layer_idx = batch, layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states: [1, H_kv, N, D] packed -> returned as is; the attention reads the caches."""
        for segment, (start, end) in zip(self.batch.segments, self.batch.bounds, strict=True):
            segment.cache.positional_layers[self.layer_idx].update(
                key_states[:, :, start:end], value_states[:, :, start:end]
            )
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        pass


class _RaggedCache(Cache):
    def __init__(self, batch: ForwardBatch, num_layers: int) -> None:
        super().__init__(layers=[_RaggedLayer(batch, i) for i in range(num_layers)])


def ragged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, N, D]
    key: torch.Tensor,  # [1, H_kv, N, D] (ignored with a plan: each session's cache is read instead)
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,  # transformers' attention kwargs (is_causal, ...), passed on to SDPA as they are
) -> tuple[torch.Tensor, None]:
    """Per-session SDPA over each session's own cache; plain SDPA when no batch is given."""
    batch = kwargs.pop(BATCH_KWARG, None)
    if not isinstance(batch, ForwardBatch):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    # torch types an unknown Module attribute as Tensor | Module; attention modules hold an int here.
    layer_idx = cast(int, module.layer_idx)
    outputs = []
    for segment, (start, end), mask in zip(batch.segments, batch.bounds, batch.masks, strict=True):
        keys, values = segment.cache.layer_kv(layer_idx)  # [1, H_kv, prefix + n, D], written above
        outputs.append(
            F.scaled_dot_product_attention(
                query[:, :, start:end], keys, values, attn_mask=mask, scale=scaling, enable_gqa=True
            )
        )  # [1, H, n, D]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None  # [1, N, H, D]


AttentionInterface.register(ATTENTION_NAME, ragged_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)  # plain forwards build SDPA's masks


def use_ragged_attention(model: PreTrainedModel) -> None:
    """Routes the model's attention through `ragged_attention` (plain SDPA when called without a plan)."""
    model.config._attn_implementation = ATTENTION_NAME
    for sub in model.modules():  # submodules that keep their own config copy
        config = getattr(sub, "config", None)
        if config is not None and getattr(config, "_attn_implementation", None) is not None:
            config._attn_implementation = ATTENTION_NAME


@torch.inference_mode()
def forward_ragged(
    model: PreTrainedModel, segments: Sequence[Segment], native: NativeDecoder | None = None
) -> list[torch.Tensor]:
    """One forward over every segment; returns each segment's logits, [n, V] (or [V] if last_only).

    Each segment's K/V lands in its own cache at [length, length + n); like `PositionalKVCache.update`,
    the cache's length moves past them (the caller commits or truncates afterwards). `native` (the
    model's lean forward, runtime/decoder.py) runs instead of transformers' module forward when given.
    """
    device = next(model.parameters()).device
    batch = ForwardBatch.of(segments, device)
    keep = list(batch.keep)
    buffers = [s.cache.features for s in segments if s.cache.features is not None]
    featured = bool(buffers)
    # decoder layers whose outputs some segment keeps (a fused hidden-state draft's input)
    wanted = sorted({layer for buffer in buffers for layer in buffer.layers})
    if native is not None:
        # keys name the layers to keep (the forward fills them in); None on the plain path
        outputs = dict.fromkeys(wanted, torch.empty(0)) if wanted else None
        hidden = native.forward(batch, outputs)  # [N, H]
        if not featured:
            return batch.split_logits(native.logits(hidden[keep]).float())  # kept rows' logits [K, V]
        normed = native.final_norm(hidden)  # [N, H]
        _store_features(batch, normed, outputs or {})
        return batch.split_logits(native.lm_head(normed[keep]).float())
    inputs = {
        "input_ids": batch.token_ids[None],  # [1, N]
        # A 4D mask is taken as given, so transformers builds none; the batch carries the real ones.
        "attention_mask": torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device),
        "position_ids": batch.positions[None],  # [1, N]
        "past_key_values": _RaggedCache(batch, model.config.num_hidden_layers),
        "use_cache": True,
        BATCH_KWARG: batch,
    }
    if featured:
        # The base model's last hidden state is the normed one its LM head reads.
        decoder = model.get_decoder()
        with capture_layer_outputs(decoder.layers, wanted) as captured:
            base = decoder(**inputs)
        normed = base.last_hidden_state[0]  # [N, H]
        _store_features(batch, normed, {layer: out[0] for layer, out in captured.items()})
        head = cast(torch.nn.Module, model.get_output_embeddings())
        return batch.split_logits(head(normed[keep]).float())
    out = model(**inputs, logits_to_keep=torch.tensor(keep, device=device))
    return batch.split_logits(out.logits[0].float())


def _store_features(
    batch: ForwardBatch,
    normed: torch.Tensor,  # [N, H] final hidden states after the last norm
    layer_outputs: dict[int, torch.Tensor],  # layer -> its output [N, H], for the layers segments keep
) -> None:
    """Each segment that keeps features gets its tokens' features at the positions their K/V took."""
    for segment, (start, end) in zip(batch.segments, batch.bounds, strict=True):
        features = segment.cache.features
        if features is None:
            continue
        if features.layers:
            features.update(side_by_side(layer_outputs, features.layers)[start:end])  # [n, k * H]
        else:
            features.update(normed[start:end])
