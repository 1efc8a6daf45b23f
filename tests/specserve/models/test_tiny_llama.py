"""Tiny random checkpoints (Llama, Qwen2): deterministic, the right shape, what sets each architecture
apart, and usable next-token distributions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specserve.errors import InvalidArgument
from specserve.models import load_causal_lm, load_tokenizer, make_tiny_llama
from specserve.models.tiny import Architecture, make_tiny_model


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(model_dir / "model.safetensors")


def test_deterministic_given_seed(tmp_path: Path) -> None:
    rng_before = torch.get_rng_state()
    a = _weights(make_tiny_llama(tmp_path / "a", vocab_size=16, seed=7))
    b = _weights(make_tiny_llama(tmp_path / "b", vocab_size=16, seed=7))
    c = _weights(make_tiny_llama(tmp_path / "c", vocab_size=16, seed=8))
    assert torch.equal(torch.get_rng_state(), rng_before)  # the caller's RNG is untouched
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


def test_config_follows_the_tokenizer(tiny_target_dir: Path, tiny_draft_dir: Path) -> None:
    target, draft = load_causal_lm(tiny_target_dir), load_causal_lm(tiny_draft_dir)
    for model in (target, draft):
        c = model.config
        assert (c.vocab_size, c.bos_token_id, c.eos_token_id, c.pad_token_id) == (49152, 1, 2, 2)
        assert not c.tie_word_embeddings
        assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert (target.config.num_hidden_layers, target.config.hidden_size) == (2, 64)
    assert (draft.config.num_hidden_layers, draft.config.hidden_size) == (1, 32)
    assert load_tokenizer(tiny_draft_dir).eos_token_id == 2


def test_the_qwen2_variant_has_what_a_llama_lacks(tiny_qwen2_target_dir: Path) -> None:
    model = load_causal_lm(tiny_qwen2_target_dir)
    c = model.config
    assert c.model_type == Architecture.QWEN2 and type(model).__name__ == "Qwen2ForCausalLM"
    assert (c.vocab_size, c.bos_token_id, c.eos_token_id, c.pad_token_id) == (49152, 1, 2, 2)
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (64, 4, 2, 32)
    assert c.rope_parameters["rope_theta"] == 1e6
    assert c.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    attention = model.model.layers[0].self_attn
    assert all(p.bias.abs().min() > 0 for p in (attention.q_proj, attention.k_proj, attention.v_proj))
    assert attention.o_proj.bias is None


def test_architectures_are_deterministic_and_differ(tmp_path: Path) -> None:
    a = _weights(make_tiny_model(tmp_path / "a", architecture="qwen2", vocab_size=16, seed=7))
    b = _weights(make_tiny_model(tmp_path / "b", architecture="qwen2", vocab_size=16, seed=7))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    llama = _weights(make_tiny_model(tmp_path / "c", architecture="llama", vocab_size=16, seed=7))
    assert "lm_head.weight" in llama and "lm_head.weight" not in a  # a tied head is stored once
    assert not any(name.endswith(".bias") for name in llama)


def test_no_tokenizer_means_no_special_ids(tiny_vocab_target_dir: Path) -> None:
    c = load_causal_lm(tiny_vocab_target_dir).config
    assert (c.vocab_size, c.bos_token_id, c.eos_token_id, c.pad_token_id) == (16, None, None, None)
    assert not (tiny_vocab_target_dir / "tokenizer.json").exists()


def test_vocab_arguments_are_checked(tmp_path: Path, default_model_dir: Path) -> None:
    with pytest.raises(InvalidArgument):
        make_tiny_llama(tmp_path / "x")
    with pytest.raises(InvalidArgument):
        make_tiny_llama(tmp_path / "y", tokenizer_dir=default_model_dir, vocab_size=100)


@pytest.mark.parametrize("fixture", ["tiny_target_dir", "tiny_vocab_target_dir", "tiny_qwen2_target_dir"])
def test_distributions_are_peaked_and_context_dependent(fixture: str, request: pytest.FixtureRequest) -> None:
    model = load_causal_lm(request.getfixturevalue(fixture))
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (4, 32), generator=torch.Generator().manual_seed(0))  # [4, 32]
    with torch.no_grad():
        logits = model(ids).logits  # [4, 32, vocab]
        alone = model(ids.reshape(-1, 1)).logits.reshape(4, 32, vocab)  # each token without context
    top_p = logits.softmax(-1).max(-1).values  # [4, 32]
    assert top_p.mean() > (0.05 if vocab > 100 else 0.3)  # far from uniform (1/vocab)
    assert top_p.mean() < 0.95  # but not one-hot: sampling tests see several tokens
    changed = (logits.argmax(-1) != alone.argmax(-1)).float().mean()
    assert changed > 0.3  # the prefix matters, not just the last token
