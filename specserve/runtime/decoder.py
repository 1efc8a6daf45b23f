"""A lean forward for Llama-family decoders (Llama, Qwen2, Mistral) over a ragged batch of sessions.

Transformers' module-by-module forward spends part of a one-token step of a small model in Python and
small ops (norms, rotary per head group, attention dispatch, cache plumbing; docs/benchmarks.md, "The
runtime", measures the difference with scripts/profile_step.py). This forward reads the same modules'
weights, so it needs no conversion and no second copy, and runs each layer as: one RMSNorm, one packed
q/k/v product, one rotary over q and k together, each session's K/V written into its own cache and
attended there, one o projection, one RMSNorm, one packed gate/up product, one down projection.
Architectures it does not know keep transformers' forward (`runtime/ragged.py`), so any causal LM still
serves. On weights as shipped (runtime/int4.py) each layer calls its four int4 products directly
(`_int4_layer`), with the same values as through the modules and fewer small ops per layer; on a CPU
where the compiled kernels build (runtime/cpu_kernels.py), attention computes each row alone in float32,
and with every product on the int8-dot kernel all the layers run in one call (runtime/fused_layers.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from specserve.runtime import cpu_kernels
from specserve.runtime.fused_layers import FusedLayers, norm_eps
from specserve.runtime.int4 import Int4Layer, int4_layers, runs_on_int4
from specserve.runtime.kernels import FusedPart
from specserve.runtime.segment import ForwardBatch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


# model_type -> the config checks under which its forward is exactly the Llama block computed here.
NATIVE_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})


def supports_native_forward(model: nn.Module) -> bool:
    """True when `model` is a decoder this module computes exactly as transformers defines it."""
    config = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    if config is None or inner is None or getattr(config, "model_type", None) not in NATIVE_MODEL_TYPES:
        return False
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "use_sliding_window", False):
        return False
    if getattr(config, "sliding_window", None) and getattr(config, "model_type", "") == "mistral":
        return False  # a windowed mask is not what the per-session masks below express
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(kind != "full_attention" for kind in layer_types):
        return False
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) != 1.0:
        return False  # the rotary below turns whole heads
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    return all(hasattr(inner, name) for name in needed) and hasattr(model, "lm_head")


def _projections(modules: Sequence[nn.Module]) -> Callable[[torch.Tensor], Sequence[torch.Tensor]]:
    """x -> each module's output. Parts of one packed product (runtime/kernels.py) run as that one
    product, split: one kernel call and no module dispatch per part."""
    products = {id(getattr(m, "product", None)) for m in modules}
    first = modules[0]
    if isinstance(first, FusedPart) and len(products) == 1 and len(modules) == len(first.product.widths):
        return first.product.parts
    return lambda x: [module(x) for module in modules]


class NativeDecoder:
    """The lean forward over a transformers Llama-family model's own modules (weights shared, not copied)."""

    def __init__(self, model: PreTrainedModel) -> None:
        if not supports_native_forward(model):
            raise ValueError(
                f"no native forward for model_type {getattr(model.config, 'model_type', None)!r}"
            )
        config = model.config
        inner = model.model
        self.embed_tokens: nn.Module = inner.embed_tokens
        self.device: torch.device = inner.norm.weight.device  # a plain parameter on every path
        self.layers: Sequence[Any] = list(inner.layers)  # Llama-family decoder layers (duck-typed)
        self.norm: nn.Module = inner.norm
        self.rotary_emb: nn.Module = inner.rotary_emb
        self.lm_head: nn.Module = model.lm_head
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = config.num_key_value_heads
        # head_dim may differ from hidden / heads (the tiny Qwen2's does); the attention's scale is its own.
        self.head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scaling: float = float(getattr(self.layers[0].self_attn, "scaling", self.head_dim**-0.5))
        self.qkv = [
            _projections([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj])
            for layer in self.layers
        ]
        self.gate_up = [_projections([layer.mlp.gate_proj, layer.mlp.up_proj]) for layer in self.layers]
        # On int4 weights the kernel reads its input in bfloat16, so attention's last-bit noise (torch's
        # attention kernels round a row differently as the number of rows changes) would flip bf16
        # roundings downstream and a tree's logits would leave the same path decoded alone. In float64
        # that noise (~1e-16) vanishes when the output is rounded back: tree rows stay bit-identical.
        # On a CPU with the compiled kernels (runtime/cpu_kernels.py) attention computes each row alone, in
        # the order a one-by-one decode would: the same bits without float64.
        on_int4 = runs_on_int4(model)
        self.row_attention = (
            on_int4
            and self.device.type == "cpu"
            and inner.norm.weight.dtype == torch.float32
            and cpu_kernels.library() is not None
        )
        self.exact_attention = on_int4 and not self.row_attention
        self.attention_dtype = torch.float64 if self.exact_attention else inner.norm.weight.dtype
        # Weights as shipped: each layer calls its four int4 products directly (`_int4_layer`), or, every
        # product on the CPU's int8-dot kernel, all layers run in one call (runtime/fused_layers.py).
        self.int4 = int4_layers(self.layers)
        self.fused: FusedLayers | None = None
        if self.row_attention and FusedLayers.supports(self.layers, inner.norm.weight.dtype):
            self.fused = FusedLayers(
                self.layers, self.num_heads, self.num_kv_heads, self.head_dim, self.scaling
            )

    @staticmethod
    def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """transformers' RMSNorm (statistics in fp32), in as few ops as it takes; torch's fused rms_norm
        measured slower on CPU for one row (its composite runs more ops)."""
        eps = norm_eps(norm)
        weight: torch.Tensor = norm.weight  # type: ignore[assignment]  # an RMSNorm's [H] parameter
        if x.dtype == torch.float32:
            return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps)))
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(eps))).to(x.dtype)

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, layer_outputs: dict[int, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Hidden states before the final norm for every packed token of `batch`, [N, H]; each segment's
        K/V lands in its own cache, attended under the batch's mask for it. `layer_outputs`: for each
        layer number it holds as a key, that layer's output [N, H] is stored under it (a fused
        hidden-state draft's input)."""
        hidden = self.embed_tokens(batch.token_ids)  # [N, H]
        cos, sin = self.rotary_emb(hidden[None], batch.positions[None])  # [1, N, D] each
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # [N, 1, D]
        # Rotary: x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1) = roll(x) with the sign moved
        # onto sin's first half (exact: negation commutes with the product).
        half = self.head_dim // 2
        sin_signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # [N, 1, D]
        if self.fused is not None:
            return self.fused.forward(hidden, cos[:, 0], sin_signed[:, 0], batch, layer_outputs)
        rotary = (cos, sin_signed)
        # row attention reads each segment's [n, L] bool mask; the others add a 0 / -inf mask to the scores
        masks = [
            (None if mask is None else mask[0, 0]) if self.row_attention else self._additive_mask(mask)
            for mask in batch.masks
        ]
        if self.exact_attention:  # `_grouped_attention`'s rows: each query head group's n rows
            groups = self.num_heads // self.num_kv_heads
            masks = [None if mask is None else mask.repeat(1, 1, groups, 1) for mask in masks]
        for index, layer in enumerate(self.layers):
            if self.int4 is not None:
                hidden = self._int4_layer(index, layer, self.int4[index], hidden, rotary, batch, masks)
            else:
                hidden = self._layer(index, layer, hidden, rotary, batch, masks)
            if layer_outputs is not None and index in layer_outputs:
                layer_outputs[index] = hidden
        return hidden

    def _additive_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """[1, 1, n, L] bool -> the same mask as 0 / -inf in the attention's dtype: what SDPA builds
        from a bool mask on every call (then adds to the scores), built once per forward here."""
        if mask is None:
            return None
        additive = torch.zeros(mask.shape, dtype=self.attention_dtype, device=mask.device)
        return additive.masked_fill_(mask.logical_not(), float("-inf"))

    def _rotate(self, qk: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """[N, heads, D] q and k heads side by side -> rotated, in one rotary for both."""
        cos, sin_signed = rotary
        # roll(x, D / 2) swaps each head's halves: one flip of the halves' axis, where roll takes a
        # narrow, a narrow and a cat (the same values, moved).
        swapped = qk.unflatten(-1, (2, self.head_dim // 2)).flip(-2).flatten(-2)  # [N, heads, D]
        return torch.addcmul(qk * cos, swapped, sin_signed)

    def _attend(
        self,
        index: int,
        q: torch.Tensor,  # [N, Hq, D]
        k: torch.Tensor,  # [N, Hkv, D]
        v: torch.Tensor,  # [N, Hkv, D]
        batch: ForwardBatch,
        masks: Sequence[torch.Tensor | None],
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """Each segment's K/V written into its cache and its queries attended there -> [N, Hq, D] in
        `dtype`, contiguous."""
        outputs = []
        for segment, (lo, hi), mask in zip(batch.segments, batch.bounds, masks, strict=True):
            cache_layer = segment.cache.positional_layers[index]
            update = cache_layer.update_exact if self.exact_attention else cache_layer.update
            keys, values = update(
                k[lo:hi].transpose(0, 1)[None], v[lo:hi].transpose(0, 1)[None]
            )  # [1, Hkv, prefix + n, D] each, float64 for exact attention
            if self.row_attention:
                attended = cpu_kernels.attend(q[lo:hi], keys, values, mask, self.scaling)
            elif self.exact_attention:
                attended = self._grouped_attention(q[lo:hi], keys, values, mask)
            else:
                attended = F.scaled_dot_product_attention(
                    q[lo:hi].transpose(0, 1)[None].to(self.attention_dtype),
                    keys,
                    values,
                    attn_mask=mask,
                    scale=self.scaling,
                    enable_gqa=True,
                )[0].transpose(0, 1)  # [n, Hq, D]
            # One copy: the cast lays the rows out contiguously for the next product.
            outputs.append(attended.to(dtype, memory_format=torch.contiguous_format))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _grouped_attention(
        self,
        q: torch.Tensor,  # [n, Hq, D]
        keys: torch.Tensor,  # [1, Hkv, L, D]
        values: torch.Tensor,  # [1, Hkv, L, D]
        mask: torch.Tensor | None,  # [1, 1, G * n, L] additive: the tree's mask repeated per group
    ) -> torch.Tensor:
        """Attention with each key/value head's G query heads as G * n rows of one head -> [n, Hq, D].
        The same values as grouped-query SDPA, in G times fewer heads of G times more rows, which the
        CPU kernel runs 10-15% faster in float64 from 4 rows up (it pays per head)."""
        n, n_q, d = q.shape
        rows = q.transpose(0, 1).to(self.attention_dtype, memory_format=torch.contiguous_format)
        grouped = rows.view(1, self.num_kv_heads, -1, d)  # [1, Hkv, G * n, D], rows (head j, token i)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=self.scaling)
        return out.view(n_q, n, d).transpose(0, 1)  # [n, Hq, D]

    def _layer(
        self,
        index: int,
        layer: Any,
        hidden: torch.Tensor,  # [N, H]
        rotary: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        masks: Sequence[torch.Tensor | None],
    ) -> torch.Tensor:
        """One decoder layer through its modules (any linear kernel) -> [N, H]."""
        attn, mlp = layer.self_attn, layer.mlp
        n_q, n_kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        x = self._rms_norm(hidden, layer.input_layernorm)  # [N, H]
        q, k, v = self.qkv[index](x)  # [N, Hq * D], [N, Hkv * D], [N, Hkv * D]
        v = v.reshape(-1, n_kv, d)  # [N, Hkv, D]
        qk = torch.cat((q.reshape(-1, n_q, d), k.reshape(-1, n_kv, d)), dim=1)  # [N, Hq + Hkv, D]
        qk = self._rotate(qk, rotary)
        attended = self._attend(index, qk[:, :n_q], qk[:, n_q:], v, batch, masks, hidden.dtype)
        hidden = hidden + attn.o_proj(attended.reshape(-1, n_q * d))
        x = self._rms_norm(hidden, layer.post_attention_layernorm)
        gate, up = self.gate_up[index](x)
        return hidden + mlp.down_proj(F.silu(gate) * up)

    def _int4_layer(
        self,
        index: int,
        layer: Any,
        ops: Int4Layer,
        hidden: torch.Tensor,  # [N, H]
        rotary: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        masks: Sequence[torch.Tensor | None],
    ) -> torch.Tensor:
        """`_layer` on weights as shipped, the same values in fewer ops: each product called directly on
        its kernel's dtype, q and k rotated where the fused product wrote them (no split and concat),
        the attention's output cast once into the o product's input, and the kernel's bf16 outputs
        promoted inside the adds that read them."""
        n_q, n_kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        compute, dtype = ops.qkv.weight.compute_dtype, hidden.dtype
        x = self._rms_norm(hidden, layer.input_layernorm)  # [N, H]
        qkv = ops.qkv.to_model(ops.qkv.weight.product(x.to(compute)), dtype)  # [N, (Hq + 2 Hkv) D]
        qk = self._rotate(qkv[:, : (n_q + n_kv) * d].unflatten(-1, (n_q + n_kv, d)), rotary)
        v = qkv[:, (n_q + n_kv) * d :].unflatten(-1, (n_kv, d))  # [N, Hkv, D]
        attended = self._attend(index, qk[:, :n_q], qk[:, n_q:], v, batch, masks, compute)
        hidden = ops.o.add_to(hidden, ops.o.weight.product(attended.flatten(1)))
        x = self._rms_norm(hidden, layer.post_attention_layernorm)
        gate_up = ops.gate_up.weight.product(x.to(compute))  # [N, 2 I]
        if ops.gate_up.bias is not None:
            gate_up = ops.gate_up.to_model(gate_up, dtype)
        gate, up = gate_up.split(layer.mlp.gate_proj.out_features, dim=-1)  # [N, I] each
        # silu(gate) * up in the model's dtype; a float32 stream promotes up inside the product.
        act = F.silu(gate.to(dtype)).mul_(up if dtype == torch.float32 else up.to(dtype))
        return ops.down.add_to(hidden, ops.down.weight.product(act.to(compute)))

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, H] hidden states before the final norm -> after it (what the LM head reads)."""
        return self._rms_norm(hidden, self.norm)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, H] hidden states (before the final norm) -> [M, V] logits."""
        return self.lm_head(self.final_norm(hidden))
