"""In-memory tiny random models for unit tests (no tokenizer, no files): Llamas, and the Qwen2 variant
(specserve/models/tiny.py) for the tests that run on every served architecture."""

from __future__ import annotations

import copy

import pytest
import torch
from gguf import GGMLQuantizationType, quants
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from specserve.models.gguf_quant import QuantizedWeight, decode
from specserve.models.tiny import Architecture, build_tiny_model, tiny_config

# Runs a test (and the module-scoped fixtures it takes that take `architecture`) once per served
# architecture; tests without it get the default `architecture` fixture (tests/conftest.py): Llama.
EACH_ARCHITECTURE = pytest.mark.parametrize("architecture", list(Architecture), ids=str, scope="module")


def tiny_llama(
    vocab_size: int = 64, hidden: int = 32, layers: int = 2, seed: int = 0, intermediate: int | None = None
) -> LlamaForCausalLM:
    """intermediate: the MLP's width (2 * hidden unless given)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.3,  # peaked distributions, so greedy paths are not decided by noise
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def tiny_qwen2(vocab_size: int = 64, hidden: int = 32, layers: int = 2, seed: int = 0) -> PreTrainedModel:
    """The Qwen2 counterpart of `tiny_llama`: q/k/v biases, heads of 2 * hidden / 4, RoPE theta 1e6 and a
    tied head (`tiny_config`), peaked logits (`build_tiny_model`)."""
    config = tiny_config(
        Architecture.QWEN2,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=layers,
        initializer_range=0.3,
    )
    config._attn_implementation = "sdpa"
    # logits of std 2, about tiny_llama's (its head's std 0.3 times sqrt(32))
    return build_tiny_model(config, seed=seed, logit_std=2.0).requires_grad_(False)


def tiny_model(architecture: Architecture, **kwargs: int) -> PreTrainedModel:
    """`tiny_llama` or `tiny_qwen2` with the same arguments."""
    return (tiny_llama if architecture is Architecture.LLAMA else tiny_qwen2)(**kwargs)


def quantize(weight: torch.Tensor, type_name: str) -> QuantizedWeight:
    """A float weight [N, K] written in a GGUF block format (the gguf package's quantizer), then decoded."""
    array = weight.detach().float().numpy()
    data = quants.quantize(array, GGMLQuantizationType[type_name])
    return decode(type_name, data, *array.shape)


def quantize_model(model: torch.nn.Module, linear: str = "Q4_1", embedding: str = "Q8_0") -> dict:
    """Every linear weight and the embedding of a tiny model, as a GGUF file would ship them."""
    out = {}
    for name, param in model.named_parameters():
        if name.endswith("embed_tokens.weight"):
            out[name] = quantize(param, embedding)
        elif param.dim() == 2:
            out[name] = quantize(param, linear)
    return out


def noisy_copy(model: PreTrainedModel, scale: float, seed: int = 1) -> PreTrainedModel:
    """A draft that agrees with `model` often but not always: its LM head is perturbed."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    if draft.config.tie_word_embeddings:  # perturb the head alone, not the input embedding it is
        draft.lm_head.weight = torch.nn.Parameter(draft.lm_head.weight.detach().clone(), requires_grad=False)
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
