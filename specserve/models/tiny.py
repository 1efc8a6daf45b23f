"""Tiny random-init Llama checkpoints for unit tests and examples (milliseconds per forward)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from specserve.errors import InvalidArgument


def make_tiny_llama(
    out_dir: Path,
    *,
    tokenizer_dir: Path | None = None,
    vocab_size: int | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    seed: int = 0,
    max_position_embeddings: int = 2048,
    rope_theta: float = 10000.0,
    logit_std: float = 4.0,
) -> Path:
    """Save a random-init `LlamaForCausalLM` (safetensors, fp32) into `out_dir` and return it.

    With `tokenizer_dir`, that tokenizer is saved alongside and its vocab size and bos/eos/pad ids are
    used (`vocab_size` may only enlarge the vocab). Without it, `vocab_size` is required and the
    config has no bos/eos/pad ids, so generation never stops early.

    Weights are deterministic given `seed`. The body is initialised with std 0.2 (not the usual 0.02,
    which gives near-uniform next-token distributions) and the LM head so that logits have std
    `logit_std`: next-token distributions are peaked (top-1 prob ~0.25 over 49k tokens, ~0.7 over 16)
    yet context-dependent, and greedy argmaxes have clear margins.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise InvalidArgument("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    tokenizer = None
    special_ids: dict[str, Any] = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if tokenizer_dir is not None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        if vocab_size is not None and vocab_size < len(tokenizer):
            raise InvalidArgument(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(tokenizer)}")
        vocab_size = vocab_size or len(tokenizer)
        special_ids = {name: getattr(tokenizer, name) for name in special_ids}
    if vocab_size is None:
        raise InvalidArgument("give vocab_size or tokenizer_dir")

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},  # 5.x name for rope_theta
        initializer_range=0.2,
        tie_word_embeddings=False,
        dtype="float32",
        **special_ids,
    )
    # fork_rng: deterministic weights without disturbing the caller's global RNG state.
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            # The final RMSNorm makes hidden states unit-RMS, so logits' std = std(W) * sqrt(hidden).
            model.lm_head.weight.normal_(0.0, logit_std / math.sqrt(hidden_size))  # [vocab, hidden]
            # Llama zeroes the pad token's embedding row; give it a normal row so that the pad token
            # (SmolLM2: pad = eos = <|im_end|>, which appears inside chat prompts) is a real input.
            model.model.embed_tokens.weight.normal_(0.0, config.initializer_range)  # [vocab, hidden]
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir
