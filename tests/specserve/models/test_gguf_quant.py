"""Decoding a GGUF file's quantized weights into 4-bit parts: every format exact against the `gguf`
package's own dequantization, the store round trip, Llama's q/k row order, and the real file against
the converted checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from specserve.models import gguf_quant
from specserve.models.gguf_quant import (
    STORE_VERSION,
    SUPPORTED_FORMATS,
    decode,
    hf_name,
    pack_nibbles,
    read_store,
    rotary_row_order,
    store_version,
    unpack_nibbles,
    write_store,
)

# Where each block format keeps its fp16 scale fields (bytes), so random blocks get sane ones.
_F16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q8_0": (0,),
    "Q5_0": (0,),
    "Q4_K": (0, 2),
    "Q6_K": (208,),
}


def random_blocks(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[N, bytes per row] of random codes with small positive fp16 scales."""
    block_bytes, block_values = quants.GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][::-1]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // block_values, block_bytes), dtype=np.uint8)
    for offset in _F16_FIELDS[type_name]:
        scale = rng.uniform(1e-3, 1e-2, blocks.shape[:2]).astype(np.float16)
        blocks[..., offset : offset + 2] = scale.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("type_name", sorted(SUPPORTED_FORMATS))
def test_every_format_decodes_to_exactly_the_files_values(type_name):
    n, k = 48, 512
    data = random_blocks(type_name, n, k)
    expected = quants.dequantize(data, GGMLQuantizationType[type_name])  # the gguf package's reading
    weight = decode(type_name, data, n, k)
    assert weight.codes.min() >= 0 and weight.codes.max() <= 15
    assert weight.source == type_name
    np.testing.assert_array_equal(weight.dequantize(), expected)


def test_formats_of_more_than_four_bits_split_into_two_parts_and_k_quants_of_16_keep_their_groups():
    assert decode("Q4_1", random_blocks("Q4_1", 16, 64), 16, 64).codes.shape[0] == 1
    assert decode("Q8_0", random_blocks("Q8_0", 16, 64), 16, 64).codes.shape[0] == 2
    six = decode("Q6_K", random_blocks("Q6_K", 16, 256), 16, 256)
    assert six.codes.shape[0] == 2 and six.group == 16 and six.scales.shape == (2, 16, 16)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_k_quants_keep_their_block_scales_which_give_the_float_scales_bit_for_bit(type_name):
    weight = decode(type_name, random_blocks(type_name, 16, 512), 16, 512)
    block = weight.block
    assert block is not None and block.d.shape == (16, 2) and block.sc.dtype == np.int8
    per_group = 256 // weight.group
    scale = np.repeat(block.d, per_group, axis=1) * block.sc.astype(np.float32)
    np.testing.assert_array_equal(scale, weight.scales[-1])  # the one part's, or the low part's (Q6_K)
    if type_name == "Q4_K":
        assert block.dmin is not None and block.m is not None
        minimum = np.repeat(block.dmin, per_group, axis=1) * block.m.astype(np.float32)
        np.testing.assert_array_equal(8 * scale - minimum, weight.zeros[0])
    else:
        assert block.dmin is None and block.m is None
    order = np.random.default_rng(2).permutation(16)
    np.testing.assert_array_equal(weight.rows(order).block.sc, block.sc[order])  # type: ignore[union-attr]
    assert decode("Q4_1", random_blocks("Q4_1", 16, 64), 16, 64).block is None


def test_a_row_of_partial_blocks_is_refused():
    with pytest.raises(ValueError, match="whole blocks"):
        decode("Q4_K", np.zeros((2, 144), dtype=np.uint8), 2, 128)


def test_nibble_packing_round_trips():
    codes = np.random.default_rng(1).integers(0, 16, (2, 8, 64), dtype=np.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (2, 8, 32)
    np.testing.assert_array_equal(unpack_nibbles(packed), codes)


def test_the_store_round_trips(tmp_path):
    weights = {
        "model.layers.0.mlp.up_proj.weight": decode("Q4_1", random_blocks("Q4_1", 32, 64), 32, 64),
        "lm_head.weight": decode("Q6_K", random_blocks("Q6_K", 16, 256), 16, 256),
    }
    path = write_store(weights, {"architecture": "llama"}, tmp_path)
    loaded = read_store(path)
    assert loaded.keys() == weights.keys()
    assert read_store(path, names=("lm_head.weight", "absent")).keys() == {"lm_head.weight"}  # just those
    for name, weight in weights.items():
        np.testing.assert_array_equal(loaded[name].codes, weight.codes)
        np.testing.assert_array_equal(loaded[name].scales, weight.scales)
        np.testing.assert_array_equal(loaded[name].zeros, weight.zeros)
        assert (loaded[name].group, loaded[name].source) == (weight.group, weight.source)
        assert (loaded[name].block is None) == (weight.block is None)
        if weight.block is not None:
            assert loaded[name].block is not None
            for part, array in weight.block.arrays().items():
                np.testing.assert_array_equal(loaded[name].block.arrays()[part], array)
    assert store_version(path) == STORE_VERSION
    assert store_version(tmp_path / "missing.safetensors") == 0


@pytest.mark.parametrize(("rows", "heads"), [(576, 9), (192, 3), (32, 4)])
def test_llama_rows_go_back_in_the_order_transformers_reads_them(rows, heads):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    stored = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    expected = LlamaTensorProcessor()._reverse_permute_weights(stored, heads, heads)
    np.testing.assert_array_equal(stored[rotary_row_order(rows, heads)], expected)


def test_names_map_to_the_hugging_face_parameters():
    assert hf_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.0.attn_norm.weight") is None


@pytest.mark.compute_only
@pytest.mark.model
def test_the_default_models_file_decodes_to_its_converted_checkpoint_exactly(default_model_dir):
    from safetensors.numpy import load_file

    from specserve.models.default_model import find_default_gguf

    weights, facts = gguf_quant.read_gguf(find_default_gguf())
    assert facts == {"architecture": "llama", "heads": 9, "kv_heads": 3}
    dense = load_file(str(default_model_dir / "model.safetensors"))
    assert len(weights) == 30 * 7 + 1  # every linear layer and the (tied) embedding
    for name, weight in weights.items():
        np.testing.assert_array_equal(weight.dequantize(), dense[name], err_msg=name)
