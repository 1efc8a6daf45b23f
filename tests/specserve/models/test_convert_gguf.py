"""`convert_gguf` turns a GGUF file of either served architecture into a safetensors checkpoint of that
architecture, with transformers' own GGUF load's logits and tokenizer.

The files are written here with `gguf.GGUFWriter` from tiny random models, laid out as llama.cpp's
converter lays them out: its tensor and metadata names, Llama's q/k rows permuted into its rotary layout
(transformers' GGUF loader permutes them back; Qwen2's are stored as they are), a head tied to the
embedding stored once (no `output.weight`), fp32 tensors, and a byte-level BPE tokenizer
(`tokenizer.ggml.model` "gpt2": 256 byte tokens, three merges, three special tokens). transformers'
Qwen2 GGUF mapping reads no head_dim (llama.cpp's Qwen2 heads are hidden / heads wide), so the Qwen2
file's heads are that wide; its q/k/v biases and theta 1e6 are what it exercises.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.convert_slow_tokenizer import bytes_to_unicode

from specserve.models import load_causal_lm, load_tokenizer
from specserve.models.default_model import convert_gguf
from specserve.models.tiny import Architecture, build_tiny_model, tiny_config

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: bos, -, eos
MERGES = ["Ġ t", "h e", "Ġt he"]
TOKENS = [*SPECIAL_TOKENS, *bytes_to_unicode().values(), "Ġt", "he", "Ġthe"]
CONTROL, NORMAL = 3, 1  # llama.cpp's token types
# Per architecture: the tiny model's shape overrides (see the module docstring) and its class.
VARIANTS = {
    Architecture.LLAMA: ({"tie_word_embeddings": False}, "LlamaForCausalLM"),
    Architecture.QWEN2: ({"head_dim": 16, "tie_word_embeddings": True}, "Qwen2ForCausalLM"),
}
# transformers module name (after model.layers.N.) -> llama.cpp's tensor name (after blk.N.)
LAYER_TENSORS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """[heads * D, in] q or k rows, half-split rotary pairs (i, i + D/2) -> llama.cpp's interleaved ones."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_gguf(model: PreTrainedModel, path: Path) -> Path:
    import gguf

    config = model.config
    architecture = config.model_type
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(f"tiny-{architecture}")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(architecture)
    writer.add_token_list(TOKENS)
    writer.add_token_types([CONTROL] * len(SPECIAL_TOKENS) + [NORMAL] * (len(TOKENS) - len(SPECIAL_TOKENS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)

    weights = {name: tensor.detach().float().numpy() for name, tensor in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])  # [V, H]
    permuted = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    for layer in range(config.num_hidden_layers):
        for module, gguf_name in LAYER_TENSORS.items():
            for kind in ("weight", "bias"):
                tensor = weights.get(f"model.layers.{layer}.{module}.{kind}")
                if tensor is None:
                    continue
                if architecture == Architecture.LLAMA and gguf_name in permuted:
                    tensor = llama_cpp_permute(tensor, permuted[gguf_name])
                writer.add_tensor(f"blk.{layer}.{gguf_name}.{kind}", np.ascontiguousarray(tensor))
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    if not config.tie_word_embeddings:  # a tied head is the embedding, stored once
        writer.add_tensor("output.weight", weights["lm_head.weight"])  # [V, H]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("architecture", list(Architecture), ids=str)
def test_a_converted_gguf_is_its_architecture_with_transformers_logits(architecture, tmp_path):
    overrides, class_name = VARIANTS[architecture]
    source = build_tiny_model(tiny_config(architecture, vocab_size=len(TOKENS), **overrides), seed=1)
    (tmp_path / "gguf").mkdir()
    gguf_path = write_gguf(source, tmp_path / "gguf" / "tiny.gguf")

    convert_gguf(gguf_path, tmp_path / "converted")
    assert any((tmp_path / "converted").glob("*.safetensors"))
    converted = load_causal_lm(tmp_path / "converted")
    config = converted.config
    assert type(converted).__name__ == class_name and config.model_type == architecture
    assert config.tie_word_embeddings == source.config.tie_word_embeddings
    assert config.rope_parameters["rope_theta"] == source.config.rope_parameters["rope_theta"]
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    has_biases = any(name.endswith("q_proj.bias") for name in converted.state_dict())
    assert has_biases == (architecture is Architecture.QWEN2)

    kwargs = {"gguf_file": gguf_path.name, "local_files_only": True}
    reference = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs).eval()
    reference_tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    tokenizer = load_tokenizer(tmp_path / "converted")
    text = "the theme, then <|im_end|>"
    token_ids = tokenizer(text).input_ids
    assert token_ids == reference_tokenizer(text).input_ids and TOKENS.index("Ġthe") in token_ids  # merged
    assert tokenizer.decode(token_ids) == text and tokenizer.eos_token == "<|im_end|>"
    ids = torch.tensor([token_ids])  # [1, n]
    with torch.no_grad():
        logits = converted(ids).logits  # [1, n, V]
        torch.testing.assert_close(logits, reference(ids).logits, atol=0, rtol=0)
        torch.testing.assert_close(logits, source(ids).logits, atol=1e-5, rtol=1e-5)  # the file is the model
