"""Models: the default SmolLM2 checkpoint, local loading, chat prompts and tiny test models."""

from specserve.models.chat import encode_chat, encode_messages
from specserve.models.default_model import DEFAULT_MODEL_NAME, build_once, default_model_dir, is_complete
from specserve.models.loading import load_causal_lm, load_tokenizer, resolve_model_dir
from specserve.models.tiny import make_tiny_llama

__all__ = [
    "DEFAULT_MODEL_NAME",
    "build_once",
    "default_model_dir",
    "encode_chat",
    "encode_messages",
    "is_complete",
    "load_causal_lm",
    "load_tokenizer",
    "make_tiny_llama",
    "resolve_model_dir",
]
