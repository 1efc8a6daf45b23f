"""The lean Llama-family forward equals transformers' own, per architecture, packed or not. The Qwen2
tiny model has what a Llama lacks: q/k/v biases, heads wider than hidden / heads, RoPE theta 1e6 and a
tied head; a forward that ignored any of them would fail here."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_llama import tiny_llama, tiny_model, tiny_qwen2
from transformers import GPT2Config, GPT2LMHeadModel

from specserve.core.tree_mask import tree_attention_mask
from specserve.models.tiny import Architecture
from specserve.runtime.decoder import supports_native_forward
from specserve.runtime.kernels import apply_linear_kernel
from specserve.runtime.ragged import forward_ragged
from specserve.runtime.runner import ModelRunner
from specserve.runtime.segment import Segment, causal_attend

ATOL = 1e-4


def tiny(architecture: Architecture):
    return tiny_model(architecture, layers=3)


def reference_logits(model, sequence: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([sequence])).logits[0]  # [n, V]


@pytest.mark.parametrize("packed", [False, True], ids=["native-kernel", "packed"])
@pytest.mark.parametrize("architecture", list(Architecture), ids=str)
def test_ragged_chains_and_trees_equal_transformers(architecture, packed):
    model, reference = tiny(architecture), tiny(architecture)
    if packed:
        apply_linear_kernel(model, "auto")
    runner = ModelRunner(model)
    assert runner.native is not None
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [20, 21, 22, 23, 24]]
    caches = [runner.new_cache(64) for _ in prompts]
    prefill = runner.forward_batch(
        [
            Segment(c, p, torch.arange(len(p)), causal_attend(0, len(p), runner.device))
            for c, p in zip(caches, prompts, strict=True)
        ]
    )
    for prompt, logits in zip(prompts, prefill, strict=True):
        torch.testing.assert_close(logits, reference_logits(reference, prompt), atol=ATOL, rtol=0)
    # one session verifies a tree, one a single token, one a chain, in one forward
    parents = [-1, 0, 0, 1, 1, 2]
    tree_tokens = [30, 31, 32, 33, 34, 35]
    depths = torch.tensor([0, 1, 1, 2, 2, 2])
    tree_attend = torch.cat(
        [torch.ones(6, 7, dtype=torch.bool), tree_attention_mask(parents, runner.device)], 1
    )
    segments = [
        Segment(caches[0], tree_tokens, 7 + depths, tree_attend),
        Segment(caches[1], [40], torch.tensor([2])),
        Segment(caches[2], [41, 42, 43], torch.arange(5, 8), causal_attend(5, 3, runner.device)),
    ]
    tree, single, chain = runner.forward_batch(segments)
    for node in range(6):  # every node equals a forward over the prompt and its own path
        path, i = [], node
        while i >= 0:
            path.insert(0, tree_tokens[i])
            i = parents[i]
        expected = reference_logits(reference, prompts[0] + path)[-1]
        torch.testing.assert_close(tree[node], expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(
        single[0], reference_logits(reference, [*prompts[1], 40])[-1], atol=ATOL, rtol=0
    )
    torch.testing.assert_close(
        chain, reference_logits(reference, [*prompts[2], 41, 42, 43])[-3:], atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("architecture", list(Architecture), ids=str)
def test_the_native_forward_matches_the_transformers_path_of_the_runner(architecture):
    model = tiny(architecture)
    apply_linear_kernel(model, "auto")
    native = ModelRunner(model)
    plain = ModelRunner(model)
    plain.native = None  # transformers' module forward through the ragged attention
    logits = []
    for runner in (native, plain):
        cache = runner.new_cache(32)
        forward_ragged(
            runner.model,
            [Segment(cache, [5, 6, 7, 8], torch.arange(4), causal_attend(0, 4, "cpu"))],
            runner.native,
        )
        logits.append(
            forward_ragged(runner.model, [Segment(cache, [9], torch.tensor([4]))], runner.native)[0]
        )
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)


def test_the_qwen2_model_exercises_what_a_llama_lacks():
    """Biases that count, heads not hidden / heads wide, theta 1e6, a tied head: the cases above prove
    the lean forward on these only if dropping any of them changes the logits."""
    model = tiny_qwen2()
    config = model.config
    assert config.head_dim * config.num_attention_heads != config.hidden_size
    assert config.rope_parameters["rope_theta"] == 1e6 and config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    unbiased = copy.deepcopy(model)
    with torch.no_grad():
        for layer in unbiased.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                projection.bias.zero_()
    sequence = [1, 2, 3, 4, 5, 6, 7]
    difference = reference_logits(model, sequence) - reference_logits(unbiased, sequence)
    assert difference.abs().max() > 1000 * ATOL


def test_architectures_without_a_native_forward_keep_transformers():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2)).eval()
    assert not supports_native_forward(gpt2)
    llama = tiny_llama(layers=1)
    llama.config.hidden_act = "gelu"  # not the block computed natively
    assert not supports_native_forward(llama)
