"""A lean forward for Llama-family decoders (Llama, Qwen2, Mistral) over a ragged batch of sessions.

Transformers' module-by-module forward spends part of a one-token step of a small model in Python and
small ops (norms, rotary per head group, attention dispatch, cache plumbing; docs/benchmarks.md, "The
runtime", measures the difference with scripts/profile_step.py). This forward reads the same modules'
weights, so it needs no conversion and no second copy, and runs each layer as: one RMSNorm, one packed
q/k/v product, one rotary over q and k together, each session's K/V written into its own cache and
attended there, one o projection, one RMSNorm, one packed gate/up product, one down projection.
Architectures it does not know keep transformers' forward (`runtime/ragged.py`), so any causal LM still
serves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from specserve.runtime.int4 import runs_on_int4
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
        self.exact_attention = runs_on_int4(model)
        self.attention_dtype = torch.float64 if self.exact_attention else inner.norm.weight.dtype

    @staticmethod
    def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """transformers' RMSNorm (statistics in fp32), in as few ops as it takes; torch's fused rms_norm
        measured slower on CPU for one row (its composite runs more ops)."""
        eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
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
        n_q, n_kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        for index, (layer, qkv, gate_up) in enumerate(zip(self.layers, self.qkv, self.gate_up, strict=True)):
            attn, mlp = layer.self_attn, layer.mlp
            x = self._rms_norm(hidden, layer.input_layernorm)  # [N, H]
            q, k, v = qkv(x)  # [N, Hq * D], [N, Hkv * D], [N, Hkv * D]
            v = v.reshape(-1, n_kv, d)  # [N, Hkv, D]
            qk = torch.cat((q.reshape(-1, n_q, d), k.reshape(-1, n_kv, d)), dim=1)  # [N, Hq + Hkv, D]
            qk = torch.addcmul(qk * cos, qk.roll(half, -1), sin_signed)  # one rotary for q and k
            q, k = qk[:, :n_q], qk[:, n_q:]
            outputs = []
            for segment, (lo, hi), mask in zip(batch.segments, batch.bounds, batch.masks, strict=True):
                cache_layer = segment.cache.positional_layers[index]
                update = cache_layer.update_exact if self.exact_attention else cache_layer.update
                keys, values = update(
                    k[lo:hi].transpose(0, 1)[None], v[lo:hi].transpose(0, 1)[None]
                )  # [1, Hkv, prefix + n, D] each, float64 for exact attention
                outputs.append(
                    F.scaled_dot_product_attention(
                        q[lo:hi].transpose(0, 1)[None].to(self.attention_dtype),
                        keys,
                        values,
                        attn_mask=mask,
                        scale=self.scaling,
                        enable_gqa=True,
                    )[0]
                    .transpose(0, 1)
                    .to(hidden.dtype)  # [n, Hq, D]
                )
            attended = outputs[0] if len(outputs) == 1 else torch.cat(outputs)  # [N, Hq, D]
            hidden = hidden + attn.o_proj(attended.reshape(-1, n_q * d))
            x = self._rms_norm(hidden, layer.post_attention_layernorm)
            gate, up = gate_up(x)
            hidden = hidden + mlp.down_proj(F.silu(gate) * up)
            if layer_outputs is not None and index in layer_outputs:
                layer_outputs[index] = hidden
        return hidden

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, H] hidden states before the final norm -> after it (what the LM head reads)."""
        return self._rms_norm(hidden, self.norm)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, H] hidden states (before the final norm) -> [M, V] logits."""
        return self.lm_head(self.final_norm(hidden))
