"""In-memory tiny random Llamas for unit tests (no tokenizer, no files)."""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(vocab_size: int = 64, hidden: int = 32, layers: int = 2, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.3,  # peaked distributions, so greedy paths are not decided by noise
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def noisy_copy(model: LlamaForCausalLM, scale: float, seed: int = 1) -> LlamaForCausalLM:
    """A draft that agrees with `model` often but not always: its LM head is perturbed."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    head = draft.lm_head.weight
    head.data += torch.randn(head.shape, generator=g) * head.std() * scale
    return draft
