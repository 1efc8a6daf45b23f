"""Turning one user message into prompt token ids with the model's own chat template."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def encode_chat(tokenizer: Any, user_message: str, system_prompt: str | None = None) -> list[int]:
    """Token ids of a single-turn chat prompt, ending with the assistant's generation prompt.

    system_prompt=None keeps the template's own behaviour: SmolLM2's template then inserts its default
    system prompt ("You are a helpful AI assistant named SmolLM, ..."). An explicit "" gives an empty
    system turn instead. Tokenizers without a chat template get the plain text encoded.
    """
    messages: list[dict[str, str]] = []
    if system_prompt is not None:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": user_message})
    if getattr(tokenizer, "chat_template", None):
        return encode_messages(tokenizer, messages, add_generation_prompt=True)
    text = user_message if not system_prompt else f"{system_prompt}\n\n{user_message}"
    return [int(t) for t in tokenizer.encode(text)]


def encode_messages(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    """Token ids of whole chat messages in the tokenizer's chat template (training renders conversations)."""
    # transformers 5.x returns a BatchEncoding unless return_dict=False.
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    return [int(t) for t in ids]
