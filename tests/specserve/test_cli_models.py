"""`specserve models` and `--model NAME`: the profile a command line names reaches EngineSettings, and a
profile that is not installed fails in one line naming the command that installs it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specserve.app.serve import stack_model_env
from specserve.catalog import DEFAULT_METHOD
from specserve.cli import _settings, build_parser, main
from specserve.errors import FailedPrecondition
from specserve.models.default_model import COMPLETE_MARKER
from specserve.models.profiles import DEFAULT_PROFILE, PROFILES

QWEN_1_5B, QWEN_0_5B = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SPECSERVE_MODEL", raising=False)
    return tmp_path


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "hi"],
        ["bench"],
        ["calibrate"],
        ["serve", "target"],
        ["stack"],
        ["train-draft", "--data", "d"],
        ["train-stopper"],
        ["eval-draft"],
    ],
)
def test_every_command_that_loads_a_target_takes_model(argv: list[str]) -> None:
    assert build_parser().parse_args([*argv, "--model", QWEN_1_5B]).model == QWEN_1_5B
    assert build_parser().parse_args(argv).model is None  # so SPECSERVE_MODEL applies


def test_model_and_the_variable_reach_engine_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECSERVE_MODEL", raising=False)
    assert _settings(build_parser().parse_args(["generate", "hi"])).model == DEFAULT_PROFILE
    monkeypatch.setenv("SPECSERVE_MODEL", QWEN_0_5B)
    assert _settings(build_parser().parse_args(["generate", "hi"])).model == QWEN_0_5B
    assert _settings(build_parser().parse_args(["generate", "hi", "--model", QWEN_1_5B])).model == QWEN_1_5B
    assert (
        _settings(build_parser().parse_args(["bench", "--draft-dtype", "float16"])).draft_dtype == "float16"
    )


def test_an_unknown_model_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["generate", "hi", "--model", "llama-70b"])
    assert exit_.value.code == 2 and QWEN_0_5B in capsys.readouterr().err


def test_an_uninstalled_model_fails_in_one_line_naming_the_install_command(empty_cache: Path, capsys) -> None:
    assert main(["generate", "hi", "--model", QWEN_1_5B, "--method", "target"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"`specserve models install {QWEN_1_5B}`" in err[0], err


def test_the_stack_checks_the_install_before_starting_anything(empty_cache: Path) -> None:
    with pytest.raises(FailedPrecondition, match=re.escape(f"specserve models install {QWEN_1_5B}")):
        stack_model_env(QWEN_1_5B)
    # The default converts on first use, in the target; the router serves each model's own default method.
    assert stack_model_env(None) == {"SPECSERVE_ROUTER_DEFAULT_METHOD": DEFAULT_METHOD}
    for profile in (QWEN_1_5B, QWEN_0_5B):
        directory = empty_cache / "models" / PROFILES[profile].cache_name
        directory.mkdir(parents=True)
        (directory / COMPLETE_MARKER).write_text("{}\n")
    assert stack_model_env(QWEN_1_5B) == {
        "SPECSERVE_MODEL": QWEN_1_5B,
        "SPECSERVE_ROUTER_DEFAULT_METHOD": PROFILES[QWEN_1_5B].default_method,
    }


def test_models_list(empty_cache: Path, capsys) -> None:
    directory = empty_cache / "models" / PROFILES[QWEN_0_5B].cache_name
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(b"x" * 1000)
    (directory / COMPLETE_MARKER).write_text("{}\n")
    assert main(["models", "list"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split() == ["NAME", "INSTALLED", "SIZE", "NOTES"]
    by_name = {row.split()[0]: row for row in rows}
    assert list(by_name) == list(PROFILES)
    assert by_name[DEFAULT_PROFILE].split()[1] == "no" and by_name[DEFAULT_PROFILE].endswith("default")
    assert f"install: specserve models install {QWEN_1_5B}" in by_name[QWEN_1_5B]
    assert f"draft {QWEN_0_5B} (bfloat16)" in by_name[QWEN_1_5B]
    assert by_name[QWEN_0_5B].split()[1:4] == ["yes", "0.00", "GB"]


def test_models_install_refuses_an_unknown_name(empty_cache: Path, capsys) -> None:
    assert main(["models", "install", "llama-70b"]) == 2
    assert "unknown model 'llama-70b'" in capsys.readouterr().err


def test_draft_weights_reach_engine_settings() -> None:
    assert _settings(build_parser().parse_args(["generate", "hi"])).draft_weights == "auto"
    for chosen in ("int8", "int4", "dense"):
        args = build_parser().parse_args(["generate", "hi", "--draft-weights", chosen])
        assert _settings(args).draft_weights == chosen
