"""Linear layers and embeddings on a file's 4-bit codes: products against the exact dequantized weight,
rows independent of the batch (what keeps speculation lossless), the fused groups, and greedy
speculative output equal to the same quantized target alone on tiny models."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_llama import noisy_copy, quantize, quantize_model, tiny_llama

from specserve.core.finish import FinishChecker
from specserve.core.loop import speculative_generate
from specserve.core.sampling_params import SamplingParams
from specserve.models.gguf_quant import QuantizedWeight
from specserve.runtime.drafter import DraftShape, ModelDrafter
from specserve.runtime.int4 import (
    Int4Embedding,
    Int4Linear,
    Int4Weight,
    apply_as_shipped,
    pack_int4,
    widen_input,
)
from specserve.runtime.kernels import FusedPart
from specserve.runtime.kv_cache import PositionalKVCache
from specserve.runtime.runner import ModelRunner
from specserve.runtime.segment import ForwardBatch
from specserve.runtime.target import LocalVerifier


def random_weight(type_name: str, n: int = 64, k: int = 256, seed: int = 0) -> QuantizedWeight:
    return quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1, type_name)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
def test_the_product_is_the_dequantized_weights_at_the_kernels_input_precision(type_name):
    weight = random_weight(type_name)
    x = torch.randn(5, 256)
    y = Int4Weight(weight).matmul(x)  # [5, 64]
    dense = torch.from_numpy(weight.dequantize())
    expected = x.bfloat16().float() @ dense.T  # the kernel reads its input in bf16
    assert y.dtype == torch.float32 and y.shape == (5, 64)
    # the output is rounded to bf16 once: relative error <= 2^-8 of the largest output
    assert (y - expected).abs().max() <= expected.abs().max() * 2**-7


def test_groups_of_16_are_padded_to_the_kernels_32_with_zero_input():
    x = torch.arange(64, dtype=torch.float32).reshape(2, 32)
    wide = widen_input(x, parts=2, group=16)  # [2, 128]: (16 inputs, 16 zeros) x 2, twice
    assert wide.shape == (2, 128)
    assert torch.equal(wide[:, :16], x[:, :16]) and not wide[:, 16:32].any()
    assert torch.equal(wide[:, 64:], wide[:, :64])
    # a Q6_K-like weight: two parts in groups of 16, through the kernel
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, (2, 32, 64), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.02, (2, 32, 4)).astype(np.float32)
    zeros = rng.uniform(-0.1, 0.1, (2, 32, 4)).astype(np.float32)
    weight = QuantizedWeight(codes, scales, zeros, 16, "Q6_K")
    x = torch.randn(3, 64)
    expected = x.bfloat16().float() @ torch.from_numpy(weight.dequantize()).T
    assert (Int4Weight(weight).matmul(x) - expected).abs().max() <= expected.abs().max() * 2**-7


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0"])
def test_a_row_of_a_many_row_product_is_bit_identical_to_the_row_alone(type_name):
    kernel = Int4Weight(random_weight(type_name, n=128, k=512))
    x = torch.randn(24, 512)
    together = kernel.matmul(x)
    for m in (1, 2, 3, 4, 5, 8, 16, 24):
        assert torch.equal(kernel.matmul(x[:m]), together[:m]), m
    alone = torch.cat([kernel.matmul(x[i : i + 1]) for i in range(24)])
    assert torch.equal(alone, together)


@pytest.mark.parametrize(("type_name", "own_integers"), [("Q8_0", True), ("Q5_0", True), ("Q4_1", False)])
def test_the_embedding_decodes_exactly_the_rows_it_looks_up(type_name, own_integers):
    """Q8_0 and Q5_0 (fp16 scales) keep their own integers, one byte a value (not two 4-bit parts in two
    bytes); a 4-bit format keeps its codes."""
    weight = random_weight(type_name, n=96, k=256)
    embedding = Int4Embedding(weight, "cpu", torch.float32)
    ids = torch.tensor([[3, 95, 0], [3, 7, 7]])
    rows = embedding(ids)
    assert rows.shape == (2, 3, 256)
    assert torch.equal(rows, torch.from_numpy(weight.dequantize())[ids])
    assert torch.equal(embedding.weight, torch.from_numpy(weight.dequantize()))
    assert (embedding.codes.dtype == torch.int8) is own_integers
    assert embedding.codes.numel() * embedding.codes.element_size() == 96 * 256


def test_a_model_runs_every_projection_on_the_codes_with_q_k_v_and_gate_up_fused():
    model = tiny_llama(vocab_size=64, hidden=32)
    weights = quantize_model(model)
    replaced = apply_as_shipped(model, weights)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, FusedPart) and isinstance(layer.mlp.up_proj, FusedPart)
    assert layer.self_attn.q_proj.product is layer.self_attn.v_proj.product
    assert isinstance(layer.self_attn.o_proj, Int4Linear) and isinstance(model.lm_head, Int4Linear)
    assert isinstance(model.model.embed_tokens, Int4Embedding)
    assert replaced == len(weights)
    # every dense view is the file's values
    for name, weight in weights.items():
        module_name = name.removesuffix(".weight")
        module = model.get_submodule(module_name)
        assert torch.equal(module.weight, torch.from_numpy(weight.dequantize())), name


def test_a_tied_head_runs_on_the_embeddings_codes():
    from tiny_llama import tiny_qwen2

    model = tiny_qwen2(vocab_size=64, hidden=32)
    assert model.config.tie_word_embeddings
    weights = quantize_model(model)
    weights.pop("lm_head.weight", None)
    apply_as_shipped(model, weights)
    assert isinstance(model.lm_head, Int4Linear)
    assert torch.equal(
        model.lm_head.weight, torch.from_numpy(weights["model.embed_tokens.weight"].dequantize())
    )


@pytest.fixture(scope="module", params=["int8-dot", "torch", "torch, float64 attention"])
def quantized_target(request) -> ModelRunner:
    """The tiny target on each CPU 4-bit kernel (int8 rows with one pass over the weights, torch's int4)
    with the compiled row attention, and on torch's kernels alone (attention in float64), as a host
    without a C++ compiler runs it."""
    from specserve.runtime import cpu_kernels

    kernel = request.param.split(",")[0]
    with pytest.MonkeyPatch.context() as patch:
        if request.param.endswith("float64 attention"):
            patch.setenv(cpu_kernels.DISABLE_ENV, "0")
        cpu_kernels.library.cache_clear()
        try:
            model = tiny_llama(vocab_size=64, hidden=32)
            apply_as_shipped(model, quantize_model(model), kernel=kernel)
            runner = ModelRunner(model)
        finally:
            cpu_kernels.library.cache_clear()
    assert runner.native is not None
    assert runner.native.row_attention != request.param.endswith("float64 attention")
    return runner


def assert_tree_nodes_equal_their_paths_decoded_alone(runner: ModelRunner) -> None:
    """A 4-node tree after a prompt: each node's logits, bit for bit, those of its path decoded one token
    at a time."""
    prompt = [3, 17, 5, 9, 41, 2]
    tree_ids, parents = [7, 11, 13, 2], [-1, 0, 0, 1]  # root 7, children 11 and 13, 2 under 11
    cache = runner.new_cache(64)
    runner.forward(cache, prompt, last_only=True)
    tree_logits = runner.forward(cache, tree_ids, parents)  # [4, V]
    for node, path in enumerate([[7], [7, 11], [7, 13], [7, 11, 2]]):
        alone = runner.new_cache(64)
        runner.forward(alone, prompt, last_only=True)
        for token in path:
            logits = runner.forward(alone, [token])
        assert torch.equal(tree_logits[node], logits[-1]), node


def test_a_tree_forward_gives_each_node_the_logits_of_its_path_decoded_alone(quantized_target):
    assert_tree_nodes_equal_their_paths_decoded_alone(quantized_target)


def test_a_tree_on_the_compiled_layers_with_a_wide_mlp_gives_each_node_its_path_decoded_alone():
    """An MLP wide enough that a tree's SiLU is split among the threads in pieces (the last one short;
    4 rows x 2,560 values) while a one-token step runs it in one piece: the same bits either way
    (csrc/layers.cpp)."""
    from specserve.runtime import cpu_kernels

    if cpu_kernels.library() is None:
        pytest.skip("no C++ compiler on this host")
    model = tiny_llama(vocab_size=64, hidden=32, intermediate=2560)
    apply_as_shipped(model, quantize_model(model), kernel="int8-dot")
    runner = ModelRunner(model)
    assert runner.native is not None and runner.native.fused is not None
    assert_tree_nodes_equal_their_paths_decoded_alone(runner)


@pytest.mark.parametrize("hidden", [32, 256])
def test_a_prompts_prefill_gives_each_position_the_logits_of_its_one_by_one_decode(hidden):
    """A prompt in one causal forward (its rows see triangles that end before the cache does: the
    attention skips what a row cannot see) and the same tokens decoded one at a time, bit for bit; at
    hidden 256 the heads are 64 wide, the size the attention's vector loops take."""
    from specserve.runtime import cpu_kernels

    if cpu_kernels.library() is None:
        pytest.skip("no C++ compiler: the compiled layers do not run")
    model = tiny_llama(vocab_size=64, hidden=hidden)
    apply_as_shipped(model, quantize_model(model), kernel="int8-dot")
    runner = ModelRunner(model)
    assert runner.native is not None and runner.native.row_attention
    prompt = [(7 * i + 3) % 60 for i in range(40)]  # past two blocks of 16 positions
    cache = runner.new_cache(64)
    runner.forward(cache, prompt[:3], last_only=True)
    together = runner.forward(cache, prompt[3:])  # [37, V]
    alone = runner.new_cache(64)
    runner.forward(alone, prompt[:3], last_only=True)
    for i, token in enumerate(prompt[3:]):
        assert torch.equal(together[i], runner.forward(alone, [token])[-1]), i


def test_greedy_speculative_output_equals_the_quantized_target_alone(quantized_target):
    draft = ModelRunner(noisy_copy(tiny_llama(vocab_size=64, hidden=32), scale=0.6))
    prompt = [3, 17, 5, 9, 41, 2, 33, 8]

    def run(drafter):
        finish = FinishChecker(48, frozenset())
        verifier = LocalVerifier(quantized_target, 256, sampling=SamplingParams())
        stats = speculative_generate(prompt, verifier, drafter, 0, finish)
        return finish.generated, stats

    reference, _ = run(None)
    for depth in (2, 4):
        generated, stats = run(ModelDrafter(draft, 256, DraftShape(depth)))
        assert generated == reference
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_the_cuda_layout_packs_on_the_meta_device():
    codes = torch.zeros(64, 576, dtype=torch.uint8, device="meta")
    packed = pack_int4(codes, torch.device("meta"))  # CUDA's packing path (not the CPU's)
    assert packed.device.type == "meta" and packed.shape[0] == 64 // 8
    with pytest.raises(ValueError, match="tiles of 32"):
        pack_int4(torch.zeros(64, 40, dtype=torch.uint8, device="meta"), torch.device("meta"))


def forwards_of_every_shape(runner: ModelRunner) -> tuple[list[torch.Tensor], list[PositionalKVCache]]:
    """Logits of two prefills, a tree and a ragged batch (a grown tree beside one token), and the caches."""
    from specserve.runtime.segment import Segment

    prompts = [[3, 17, 5, 9, 41, 2], [8, 1]]
    caches = [runner.new_cache(64) for _ in prompts]
    out = [runner.forward(cache, prompt) for cache, prompt in zip(caches, prompts, strict=True)]
    out.append(runner.forward(caches[0], [7, 11, 13, 2], [-1, 0, 0, 1]))  # a tree
    caches[0].truncate(len(prompts[0]))
    tree = Segment(caches[0], [7, 11], torch.tensor([6, 7]), torch.ones(2, 8, dtype=torch.bool).tril(6))
    single = Segment(caches[1], [40], torch.tensor([2]))
    return out + runner.forward_batch([tree, single]), caches


@pytest.mark.parametrize("make", ["llama", "qwen2"])
def test_the_lean_int4_layer_gives_the_module_paths_logits_bit_for_bit(make):
    """The as-shipped layer (runtime/decoder.py `_int4_layer`: products called directly, casts folded
    into the ops that read them) computes the same values as the layer through its modules, on a
    prefill, a tree and a ragged batch; the Qwen2 model adds q/k/v biases and a tied head."""
    from tiny_llama import tiny_qwen2

    model = tiny_llama(vocab_size=64, hidden=32) if make == "llama" else tiny_qwen2(vocab_size=64, hidden=32)
    apply_as_shipped(model, quantize_model(model))
    lean = ModelRunner(model)
    assert lean.native is not None and lean.native.int4 is not None
    lean.native.fused = None  # the layer in torch ops (the compiled layers: the next test)
    modules = ModelRunner(model)
    assert modules.native is not None
    modules.native.int4 = modules.native.fused = None  # the generic layer, through each module

    expected, _ = forwards_of_every_shape(modules)
    got, _ = forwards_of_every_shape(lean)
    for want, have in zip(expected, got, strict=True):
        assert torch.equal(want, have)


@pytest.mark.parametrize("make", ["llama", "qwen2", "qwen2, v and down in Q8_0"])
def test_the_compiled_layers_compute_the_torch_layers_values_and_fill_layer_outputs(make):
    """All layers in one call into the library (runtime/fused_layers.py) against the as-shipped layer in
    torch ops, on a prefill, a tree and a ragged batch: the same values to float32 rounding (norms and
    SiLU are computed in another order), each segment's cache advanced alike, and a layer's output kept
    where a fused hidden-state draft asks for it. With v and down in another format than q and k (as
    Q4_K_M files ship them), q, k and v run as three products and v and down on the 8-bit kernel."""
    from tiny_llama import tiny_qwen2

    from specserve.runtime import cpu_kernels
    from specserve.runtime.segment import Segment

    if cpu_kernels.library() is None:
        pytest.skip("no C++ compiler on this host")
    model = tiny_llama(vocab_size=64, hidden=32) if make == "llama" else tiny_qwen2(vocab_size=64, hidden=32)
    weights = quantize_model(model)
    if "Q8_0" in make:
        for name, param in model.named_parameters():
            if name.endswith(("v_proj.weight", "down_proj.weight")):
                weights[name] = quantize(param, "Q8_0")
    apply_as_shipped(model, weights, kernel="int8-dot")
    compiled = ModelRunner(model)
    assert compiled.native is not None and compiled.native.fused is not None
    layer = compiled.native.fused.layers[0]
    assert (layer.qkv.count, layer.down.bits) == ((3, 8) if "Q8_0" in make else (1, 4))
    torch_ops = ModelRunner(model)
    assert torch_ops.native is not None
    torch_ops.native.fused = None

    def run(runner: ModelRunner) -> tuple[list[torch.Tensor], list[int]]:
        out, caches = forwards_of_every_shape(runner)
        assert runner.native is not None
        batch = ForwardBatch.of(
            [Segment(runner.new_cache(8), [5, 6, 7], torch.arange(3))], torch.device("cpu")
        )
        kept: dict[int, torch.Tensor] = {0: torch.empty(0)}
        out.append(runner.native.forward(batch, kept))
        out.append(kept[0])
        return out, [cache.length for cache in caches]

    (expected, expected_lengths), (got, got_lengths) = run(torch_ops), run(compiled)
    assert got_lengths == expected_lengths
    for want, have in zip(expected, got, strict=True):
        torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-4)


def test_only_a_model_whose_every_projection_runs_on_codes_takes_the_int4_layer():
    dense = ModelRunner(tiny_llama(vocab_size=64, hidden=32))
    assert dense.native is not None and dense.native.int4 is None
    model = tiny_llama(vocab_size=64, hidden=32)
    weights = quantize_model(model)
    weights.pop("model.layers.1.mlp.down_proj.weight")  # one projection stays dense
    apply_as_shipped(model, weights)
    partial = ModelRunner(model)
    assert partial.native is not None and partial.native.int4 is None


def test_grouped_query_rows_attend_as_grouped_query_attention(quantized_target):
    """`_grouped_attention` (each key/value head's query heads as rows of one head) computes
    grouped-query attention: the same values to float64's last bits, with a tree's mask."""
    import torch.nn.functional as F

    from specserve.core.tree_mask import tree_attention_mask

    decoder = quantized_target.native
    assert decoder is not None
    if not decoder.exact_attention:
        pytest.skip("this target attends with the compiled row attention, not in float64")
    n, heads, kv_heads, d = 5, decoder.num_heads, decoder.num_kv_heads, decoder.head_dim
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(n, heads, d, generator=generator)
    keys, values = (torch.randn(1, kv_heads, 12, d, generator=generator, dtype=torch.float64) for _ in "kv")
    attend = torch.ones(n, 12, dtype=torch.bool)
    attend[:, 7:] = tree_attention_mask([-1, 0, 0, 1, 2], attend.device)  # the tree's own nodes
    mask = decoder._additive_mask(attend[None, None])  # [1, 1, n, 12]
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None].double(), keys, values, attn_mask=mask, scale=decoder.scaling, enable_gqa=True
    )[0].transpose(0, 1)
    groups = heads // kv_heads
    got = decoder._grouped_attention(q, keys, values, mask.repeat(1, 1, groups, 1))
    assert got.shape == (n, heads, d)
    torch.testing.assert_close(got, expected, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("kernel", ["int8-dot", "torch"])
@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q6_K"])
def test_a_fused_product_gives_each_projection_its_own_products_columns_bit_for_bit(type_name, kernel):
    """One kernel call over q/k/v (or gate/up) stacked along the outputs computes each output column as
    that projection's own product does (the kernel's columns are independent), for one-part, two-part
    and groups-of-16 formats, at 1 to 9 rows."""
    from specserve.runtime.int4 import Int4Product

    k = 256

    def member(n: int, seed: int) -> QuantizedWeight:
        if type_name != "Q6_K":
            return random_weight(type_name, n=n, k=k, seed=seed)
        rng = np.random.default_rng(seed)  # the gguf package does not write Q6_K: its layout, random
        codes = rng.integers(0, 16, (2, n, k), dtype=np.uint8)
        scales = rng.uniform(0.01, 0.02, (2, n, k // 16)).astype(np.float32)
        zeros = rng.uniform(-0.1, 0.1, scales.shape).astype(np.float32)
        return QuantizedWeight(codes, scales, zeros, 16, "Q6_K")

    members = [member(n, seed) for seed, n in enumerate((64, 32, 32))]
    fused = Int4Product(members, [None, None, None], torch.device("cpu"), torch.bfloat16, kernel)
    alone = [Int4Weight(member, kernel=kernel) for member in members]
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(1))
    for m in (1, 2, 4, 5, 9):
        for part, weight in zip(fused.parts(x[:m]), alone, strict=True):
            assert torch.equal(part, weight.matmul(x[:m])), (type_name, m)
