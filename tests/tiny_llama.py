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


def exact_joint_of_tokens_2_and_3(
    runner_model: LlamaForCausalLM, prompt: list[int], params, vocab_size: int
) -> torch.Tensor:
    """P(x2, x3) [V, V] under the target alone, x1..x3 enumerated exactly (x1 comes from the prefill,
    x2 and x3 from the first speculative round, which is what the statistical loop tests check)."""
    from specserve.core.sampling import logits_to_probs

    def probs(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return logits_to_probs(runner_model(torch.tensor([ids])).logits[0, -1], params)

    joint = torch.zeros(vocab_size, vocab_size)
    p1 = probs(prompt)
    for x1 in range(vocab_size):
        p2 = probs([*prompt, x1])
        for x2 in range(vocab_size):
            joint[x2] += p1[x1] * p2[x2] * probs([*prompt, x1, x2])
    return joint
