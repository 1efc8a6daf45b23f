"""Tiny random-init checkpoints of the served architectures (Llama, Qwen2) for unit tests and examples
(milliseconds per forward).

Each architecture's tiny variant exercises what sets it apart, so that code which assumes one family's
shapes fails on the other: the Qwen2 one has q/k/v biases (non-zero), heads wider than hidden / heads
(an explicit `head_dim`), RoPE theta 1e6 and a head tied to the input embedding; the Llama one has none
of these (no biases, head_dim = hidden / heads, theta 1e4, an untied head).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specserve.errors import InvalidArgument

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


class Architecture(StrEnum):
    """A decoder family with a tiny variant; the value is transformers' `model_type`."""

    LLAMA = "llama"
    QWEN2 = "qwen2"


@dataclass(frozen=True)
class _Variant:
    head_dim_factor: int  # head_dim = factor * hidden / heads unless given
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool  # the architecture's q/k/v projections carry biases (initialised non-zero here)


_VARIANTS = {
    Architecture.LLAMA: _Variant(
        head_dim_factor=1, rope_theta=10000.0, tie_word_embeddings=False, qkv_bias=False
    ),
    # Qwen2.5-Coder's biased q/k/v and theta 1e6; beyond it, heads twice hidden / heads wide (configs may
    # set head_dim apart: no code may derive it from hidden_size) and a tied head (Llama's is untied).
    Architecture.QWEN2: _Variant(head_dim_factor=2, rope_theta=1e6, tie_word_embeddings=True, qkv_bias=True),
}


def tiny_config(
    architecture: Architecture | str,
    *,
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    rope_theta: float | None = None,
    tie_word_embeddings: bool | None = None,
    initializer_range: float = 0.2,
    special_ids: dict[str, Any] | None = None,
) -> PretrainedConfig:
    """The transformers config of a tiny `architecture` model; None = the architecture's variant's value
    (head_dim, rope_theta, tie_word_embeddings; see the module docstring)."""
    from transformers import LlamaConfig, Qwen2Config

    architecture = Architecture(architecture)
    variant = _VARIANTS[architecture]
    if num_heads % num_kv_heads:
        raise InvalidArgument("num_heads must divide by num_kv_heads")
    if head_dim is None:
        if (variant.head_dim_factor * hidden_size) % num_heads:
            raise InvalidArgument("hidden_size must divide by num_heads (or give head_dim)")
        head_dim = variant.head_dim_factor * hidden_size // num_heads
    config_class = {Architecture.LLAMA: LlamaConfig, Architecture.QWEN2: Qwen2Config}[architecture]
    return config_class(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        # transformers >= 5 keeps rope_theta in rope_parameters
        rope_parameters={
            "rope_type": "default",
            "rope_theta": variant.rope_theta if rope_theta is None else rope_theta,
        },
        initializer_range=initializer_range,
        tie_word_embeddings=(
            variant.tie_word_embeddings if tie_word_embeddings is None else tie_word_embeddings
        ),
        dtype="float32",
        **(special_ids or {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}),
    )


def build_tiny_model(config: PretrainedConfig, *, seed: int = 0, logit_std: float = 4.0) -> PreTrainedModel:
    """A random-init model of `config` (from `tiny_config`) in eval mode, deterministic given `seed`.

    The body is initialised with std `config.initializer_range` (0.2, not the usual 0.02, which gives
    near-uniform next-token distributions) and the LM head so that logits have std `logit_std`:
    next-token distributions are peaked (top-1 prob ~0.25 over 49k tokens, ~0.7 over 16) yet
    context-dependent, and greedy argmaxes have clear margins. A tied head is the input embedding, so
    the embedding takes the head's scale. q/k/v biases, where the architecture has them, are as large as
    the projections' outputs, so a forward that drops them gives clearly different logits.
    """
    import torch
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    architecture = Architecture(config.model_type)
    model_class = {Architecture.LLAMA: LlamaForCausalLM, Architecture.QWEN2: Qwen2ForCausalLM}[architecture]
    hidden_size: int = config.hidden_size
    # fork_rng: deterministic weights without disturbing the caller's global RNG state.
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_class(config)
        with torch.no_grad():
            # The final RMSNorm makes hidden states unit-RMS, so logits' std = std(W) * sqrt(hidden).
            model.lm_head.weight.normal_(0.0, logit_std / math.sqrt(hidden_size))  # [vocab, hidden]
            if not config.tie_word_embeddings:
                # Embeddings zero the pad token's row; give it a normal row so that the pad token
                # (SmolLM2: pad = eos = <|im_end|>, which appears inside chat prompts) is a real input.
                model.model.embed_tokens.weight.normal_(0.0, config.initializer_range)  # [vocab, hidden]
            if _VARIANTS[architecture].qkv_bias:
                bias_std = config.initializer_range * math.sqrt(hidden_size)  # a projection output's std
                for layer in model.model.layers:
                    attention = layer.self_attn
                    for projection in (attention.q_proj, attention.k_proj, attention.v_proj):
                        projection.bias.normal_(0.0, bias_std)  # [heads * head_dim]
    return model.eval()


def make_tiny_model(
    out_dir: Path,
    *,
    architecture: Architecture | str,
    tokenizer_dir: Path | None = None,
    vocab_size: int | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    seed: int = 0,
    max_position_embeddings: int = 2048,
    rope_theta: float | None = None,
    tie_word_embeddings: bool | None = None,
    logit_std: float = 4.0,
) -> Path:
    """Save a random-init `architecture` causal LM (safetensors, fp32) into `out_dir` and return it.

    With `tokenizer_dir`, that tokenizer is saved alongside and its vocab size and bos/eos/pad ids are
    used (`vocab_size` may only enlarge the vocab). Without it, `vocab_size` is required and the
    config has no bos/eos/pad ids, so generation never stops early. Weights: `build_tiny_model`.
    """
    from transformers import AutoTokenizer

    out_dir = Path(out_dir)
    tokenizer = None
    special_ids: dict[str, Any] | None = None
    if tokenizer_dir is not None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        if vocab_size is not None and vocab_size < len(tokenizer):
            raise InvalidArgument(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(tokenizer)}")
        vocab_size = vocab_size or len(tokenizer)
        special_ids = {
            name: getattr(tokenizer, name) for name in ("bos_token_id", "eos_token_id", "pad_token_id")
        }
    if vocab_size is None:
        raise InvalidArgument("give vocab_size or tokenizer_dir")
    config = tiny_config(
        architecture,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta,
        tie_word_embeddings=tie_word_embeddings,
        special_ids=special_ids,
    )
    model = build_tiny_model(config, seed=seed, logit_std=logit_std)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir


def make_tiny_llama(out_dir: Path, **kwargs: Any) -> Path:
    """`make_tiny_model` with `architecture="llama"`."""
    return make_tiny_model(out_dir, architecture=Architecture.LLAMA, **kwargs)
