"""What the distillation tests share: a tiny target, its answers to seven prompts (generated once, as
`training/generation.py` writes them) and the features of those answers (`distill features`, top 4)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from specserve.models import load_tokenizer
from specserve.training.distill.feature_extraction import extract_features
from specserve.training.generation import ANSWERS, GenerationSettings, run_stage
from specserve.training.prompt_set import Prompt, user

PROMPTS = [Prompt("test", user(f"Tell me about topic number {i}.")) for i in range(7)]
SETTINGS = GenerationSettings(
    shard_size=4, batch_size=2, max_new_tokens=6, dtype="float32", static_cache=False
)


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    """The tiny target (float32) and its tokenizer."""
    return AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval(), load_tokenizer(tiny_target_dir)


@pytest.fixture(scope="module")
def generated(tiny, tmp_path_factory) -> Path:
    """A generation directory: the target's answers to PROMPTS, in two shards."""
    model, tokenizer = tiny
    root = tmp_path_factory.mktemp("generated")
    run_stage(model, tokenizer, root / ANSWERS, lambda: list(PROMPTS), SETTINGS, log=lambda _: None)
    return root


@pytest.fixture(scope="module")
def features(tiny, generated, tmp_path_factory) -> Path:
    """The features of the generated answers: the layers a default draft reads, the top 4."""
    model, _ = tiny
    out = tmp_path_factory.mktemp("features")
    extract_features(model, generated, out, top_k=4, log=lambda _: None)
    return out
