"""Chat prompts use SmolLM2's own ChatML template."""

from __future__ import annotations

from pathlib import Path

from specserve.models import encode_chat, load_tokenizer

_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def test_chatml_special_tokens(default_model_dir: Path) -> None:
    tok = load_tokenizer(default_model_dir)
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    assert (tok.eos_token_id, tok.pad_token_id) == (2, 2)


def test_default_system_prompt_is_the_models_own(default_model_dir: Path) -> None:
    tok = load_tokenizer(default_model_dir)
    ids = encode_chat(tok, "Hi!")
    assert all(type(t) is int for t in ids)
    assert ids[0] == 1
    assert ids[-4:] == [1, 520, 9531, 198]  # "<|im_start|>assistant\n": the generation prompt
    assert tok.decode(ids) == (
        f"<|im_start|>system\n{_DEFAULT_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )


def test_explicit_system_prompt(default_model_dir: Path) -> None:
    tok = load_tokenizer(default_model_dir)
    ids = encode_chat(tok, "Hi!", system_prompt="Be brief.")
    assert tok.decode(ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )


def test_without_chat_template_falls_back_to_plain_text(default_model_dir: Path) -> None:
    tok = load_tokenizer(default_model_dir)
    tok.chat_template = None
    assert encode_chat(tok, "Hi there") == tok.encode("Hi there")
    assert tok.decode(encode_chat(tok, "Hi there", system_prompt="Sys")) == "Sys\n\nHi there"
