"""The CLI contract: JSON keys, and bad input -> one line on stderr, exit 2, no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specserve.catalog import CATALOG
from specserve.cli import main


def _run(args, env_extra=None):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "specserve.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "hi", "--max-new-tokens", "0"],
        ["generate", "hi", "--max-new-tokens", "100000000"],
        ["generate", "hi", "--temperature", "-0.5"],
        ["generate", "hi", "--top-p", "0"],
        ["generate", "hi", "--top-p", "1.5"],
        ["generate", "hi", "--method", "nope"],
        ["generate", "hi", "--method", "glide+mcsd"],
        ["generate", "hi", "--method", "glide+svip+cape"],
        ["generate", "hi", "--json-schema", "/nonexistent/schema.json"],
        ["generate", "hi", "--regex", " "],
        ["generate", "hi", "--json-object", "--method", "hf"],
        ["bench", "--prompts", "/nonexistent/prompts.jsonl"],
        ["eval-draft", "--per-category", "0"],
        ["eval-draft", "--draft", "/nonexistent/draft"],
    ],
)
def test_bad_input_fails_fast_with_one_line(args, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specserve: error:"), err


def test_methods_lists_every_name_with_its_axes(capsys, monkeypatch):
    monkeypatch.delenv("SPECSERVE_MODEL", raising=False)  # the default model, whose default is marked
    assert main(["methods"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split()[1] for line in lines[1 : 1 + len(CATALOG)]}
    assert rows == {name: info.axes_spelling or "(transformers)" for name, info in CATALOG.items()}
    assert any(line.startswith("eagle-cape-suffix ") and line.endswith("(default)") for line in lines)
    assert any("[LOSSY: opt-in]" in line for line in lines if line.startswith("mcsd-target-init "))
    assert lines[-1].startswith(
        "--method takes a name or any valid axes, DRAFT[+TREE[-DEPTH]][+STOP][+suffix]"
    )


@pytest.mark.compute_only
@pytest.mark.model
@pytest.mark.parametrize("prompt", ["", "word " * 9000])  # longer than the model's 8,192-token context
def test_bad_prompts_fail_without_traceback(prompt, default_model_dir):
    proc = _run(["generate", prompt, "--model-dir", str(default_model_dir)])
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "specserve: error:" in proc.stderr


@pytest.mark.compute_only
@pytest.mark.model
def test_generate_json_contract(default_model_dir):
    proc = _run(["generate", "Say hello.", "--json", "--max-new-tokens", "12", "--method", "vanilla-tree"])
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert {"text", "token_ids", "stats"} <= out.keys()
    assert {
        "num_target_forwards",
        "num_draft_tokens",
        "num_accepted_tokens",
        "mean_accepted_length",
        "tokens_per_s",
    } <= out["stats"].keys()
    assert 0 < len(out["token_ids"]) <= 12
