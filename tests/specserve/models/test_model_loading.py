"""Resolving and loading local model directories."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from specserve.errors import FailedPrecondition, InvalidArgument, NotFound
from specserve.models import load_causal_lm, load_tokenizer, resolve_model_dir
from specserve.settings import EngineSettings


def test_missing_dir_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="does not exist"):
        resolve_model_dir(tmp_path / "nope", tmp_path)
    with pytest.raises(NotFound, match="does not exist"):
        load_causal_lm(tmp_path / "nope")
    with pytest.raises(NotFound, match="does not exist"):
        load_tokenizer(tmp_path / "nope")


def test_dir_without_config_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFound, match=r"no config\.json"):
        resolve_model_dir(tmp_path, tmp_path)
    with pytest.raises(NotFound, match="no tokenizer"):
        load_tokenizer(tmp_path)


def test_resolve_keeps_a_given_dir(tiny_target_dir: Path, tmp_path: Path) -> None:
    assert resolve_model_dir(tiny_target_dir, tmp_path / "unused-cache") == tiny_target_dir


def test_resolve_none_is_the_default_model(default_model_dir: Path) -> None:
    assert resolve_model_dir(None, EngineSettings.from_env().cache_dir) == default_model_dir


def test_pickle_only_checkpoint_is_refused(tiny_target_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tiny_target_dir / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(FailedPrecondition, match="safetensors"):
        load_causal_lm(tmp_path)


def test_loaded_model_is_ready_for_inference(tiny_target_dir: Path) -> None:
    model = load_causal_lm(tiny_target_dir)
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.config._attn_implementation == "sdpa"


def test_dtype_is_applied(tiny_target_dir: Path) -> None:
    model = load_causal_lm(tiny_target_dir, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with pytest.raises(InvalidArgument, match="dtype"):
        load_causal_lm(tiny_target_dir, dtype="int8")


def test_tokenizer_loads(tiny_target_dir: Path) -> None:
    assert load_tokenizer(tiny_target_dir).convert_tokens_to_ids("<|im_start|>") == 1
