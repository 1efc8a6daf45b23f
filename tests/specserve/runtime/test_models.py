"""The served models (runtime/models.py): what the engine and the target and draft services load, and
where from. Models load on first use, each once; the vanilla methods' drafter is the trained one-layer
block when there is one, else the separate causal-LM draft; a model profile names its checkpoints, its
draft's dtype, and how to install what is missing.

Tiny models stand in for the Qwen checkpoints (installed into a temporary cache under the profiles'
directory names): what is tested is where the models come from and how they load, not the Qwen weights.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from specserve.errors import FailedPrecondition, InvalidArgument
from specserve.glide.drafter import GlideDrafter
from specserve.glide.model import build_glide, save_glide
from specserve.models.default_model import COMPLETE_MARKER
from specserve.models.profiles import model_profile
from specserve.runtime.batching import Scheduler
from specserve.runtime.drafter import DraftShape, ModelDrafter
from specserve.runtime.kv_cache import PositionalKVCache
from specserve.runtime.models import ServedModels
from specserve.settings import EngineSettings

QWEN_1_5B, QWEN_0_5B = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
LOADED = ("target_model", "target_runner", "tokenizer", "glide_draft", "vanilla_draft_runner", "cost_model")


def install_as(profile: str, checkpoint: Path, cache_dir: Path) -> Path:
    """`checkpoint` where `specserve models install` would have put the profile's."""
    dest = cache_dir / "models" / model_profile(profile).cache_name
    shutil.copytree(checkpoint, dest)
    (dest / COMPLETE_MARKER).write_text("{}\n")
    return dest


def loaded(models: ServedModels) -> set[str]:
    """Which of the heavy attributes have been loaded (functools.cached_property keeps them in __dict__)."""
    return {name for name in LOADED if name in vars(models)}


def test_models_load_on_first_use_and_once(tiny_target_dir: Path, tiny_draft_dir: Path) -> None:
    models = ServedModels(EngineSettings(model_dir=tiny_target_dir, draft_dir=tiny_draft_dir))
    assert loaded(models) == set()  # constructing loads nothing: a service reports its own progress
    runner = models.target_runner
    assert loaded(models) == {"target_model", "target_runner"}  # no draft, no tokenizer
    assert models.target_runner is runner and runner.model is models.target_model
    assert models.target_vocab_size == models.target_model.config.vocab_size


def test_the_vanilla_drafter_is_the_separate_draft_model(tiny_target_dir: Path, tiny_draft_dir: Path) -> None:
    models = ServedModels(EngineSettings(model_dir=tiny_target_dir, draft_dir=tiny_draft_dir))
    cache = models.target_runner.new_cache(64)
    drafter = models.vanilla_drafter(cache, 64, DraftShape(depth=3))
    assert isinstance(drafter, ModelDrafter)
    assert drafter.runner is models.vanilla_draft_runner
    assert models.vanilla_draft_runner.model.config.hidden_size == 32  # the tiny draft, not the target's
    drafter.release()


def test_a_trained_vanilla_block_wins_over_the_target_s_first_layers(
    tmp_path: Path, tiny_target_dir: Path
) -> None:
    plain = ServedModels(EngineSettings(model_dir=tiny_target_dir, draft_layers=1))
    block = build_glide(plain.target_model, seed=3, share_target_embeddings=True, cross_attention=False)
    save_glide(block, tmp_path / "vanilla")
    models = ServedModels(EngineSettings(model_dir=tiny_target_dir, vanilla_dir=tmp_path / "vanilla"))
    cache: PositionalKVCache = models.target_runner.new_cache(64)
    drafter = models.vanilla_drafter(cache, 64, DraftShape(depth=2))
    assert isinstance(drafter, GlideDrafter)
    assert not models.vanilla_glide_draft.config.cross_attention  # type: ignore[union-attr]
    assert "vanilla_draft_runner" not in vars(models)  # the early-exit draft was never built
    drafter.release()
    # Without a trained block (and no separate draft) the target's first layers draft.
    early_exit = plain.vanilla_drafter(plain.target_runner.new_cache(64), 64, DraftShape(depth=2))
    assert isinstance(early_exit, ModelDrafter)


def test_a_draft_with_another_vocabulary_is_refused(
    tiny_target_dir: Path, tiny_vocab_target_dir: Path
) -> None:
    models = ServedModels(EngineSettings(model_dir=tiny_target_dir, draft_dir=tiny_vocab_target_dir))
    with pytest.raises(InvalidArgument, match="vocabulary"):
        _ = models.vanilla_draft_runner


def test_an_uninstalled_target_names_its_install_command(tmp_path: Path) -> None:
    models = ServedModels(EngineSettings(model=QWEN_1_5B, cache_dir=tmp_path))
    with pytest.raises(FailedPrecondition, match=re.escape(f"`specserve models install {QWEN_1_5B}`")):
        _ = models.model_dir


def test_an_uninstalled_draft_names_its_install_command(tmp_path: Path, tiny_target_dir: Path) -> None:
    install_as(QWEN_1_5B, tiny_target_dir, tmp_path)
    models = ServedModels(EngineSettings(model=QWEN_1_5B, cache_dir=tmp_path, weights="dense"))
    assert models.model_dir == tmp_path / "models" / "Qwen2.5-Coder-1.5B-Instruct"
    with pytest.raises(FailedPrecondition, match=re.escape(f"`specserve models install {QWEN_0_5B}`")):
        _ = models.draft_model_dir


@pytest.mark.parametrize(
    ("overrides", "draft_dtype"),
    [
        ({}, "bfloat16"),  # the profile's own draft, in the profile's draft dtype
        ({"draft_dtype": "float16"}, "float16"),  # set explicitly
        ({"draft_dir": Path("/elsewhere")}, "float32"),  # another draft: the target's dtype
        ({"model_dir": Path("/elsewhere")}, "float32"),  # another target: not the profile's draft
        ({"model": QWEN_0_5B}, "float32"),  # a profile without a draft
    ],
)
def test_the_draft_dtype(overrides: dict, draft_dtype: str, monkeypatch) -> None:
    # a CPU whose oneDNN has a bf16 path (AVX-512): what the profile asks for, bf16, is fast there
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    # dense: on the file's own weights (`auto`, where the profile's wheels are installed) the draft runs
    # in float32 whatever the profile says (tests/specserve/runtime/test_draft_runtime.py)
    settings = EngineSettings(**{"model": QWEN_1_5B, "weights": "dense", **overrides})
    assert ServedModels(settings).draft_dtype == draft_dtype


def test_on_a_cpu_without_a_bf16_kernel_the_profile_s_draft_runs_in_float32(monkeypatch) -> None:
    # an AVX2-only CPU: torch would emulate bf16 ~4x slower than packed fp32, and fp32 costs no exactness
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert ServedModels(EngineSettings(model=QWEN_1_5B, weights="dense")).draft_dtype == "float32"
    explicit = EngineSettings(model=QWEN_1_5B, draft_dtype="bfloat16", weights="dense")  # asked for: kept
    assert ServedModels(explicit).draft_dtype == "bfloat16"
    assert ServedModels(EngineSettings(model=QWEN_1_5B, device="cuda")).draft_dtype == "bfloat16"


def test_the_profile_s_draft_loads_in_its_dtype(
    tmp_path: Path, tiny_target_dir: Path, tiny_draft_dir: Path
) -> None:
    install_as(QWEN_1_5B, tiny_target_dir, tmp_path)
    draft_dir = install_as(QWEN_0_5B, tiny_draft_dir, tmp_path)
    models = ServedModels(EngineSettings(model=QWEN_1_5B, cache_dir=tmp_path, weights="dense"))
    assert models.draft_model_dir == draft_dir
    # bf16 where this CPU has a bf16 kernel, else float32 (test_the_draft_dtype pins both)
    assert models.draft_dtype == ("bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32")
    assert models.vanilla_draft_runner.model.dtype == getattr(torch, models.draft_dtype)
    assert models.target_model.dtype == torch.float32


def test_a_measurement_a_session_starts_inside_a_batch_runs_forwards_of_its_own(
    tiny_target_dir: Path, tmp_path: Path
) -> None:
    """On a host with no calibration, a session's first round asks for the verify curve and it is
    measured then, inside the batch of sessions: its timed forwards must carry none of the other
    sessions' segments (nor wait for them), or the curve saved for every later session would be theirs."""
    settings = EngineSettings(
        model_dir=tiny_target_dir, calibration_path=tmp_path / "curve.json", cache_dir=tmp_path
    )
    models = ServedModels(settings)
    runner = models.target_runner
    other = runner.new_cache(64)
    shared: list[int] = []  # sizes of forwards that carried the other session beside anything else
    forward_batch = runner.forward_batch

    def recording(segments):
        if any(s.cache is other for s in segments) and len(segments) > 1:
            shared.append(len(segments))
        return forward_batch(segments)

    runner.forward_batch = recording  # type: ignore[method-assign]
    session = lambda: [runner.forward(other, [1]) for _ in range(20)]  # noqa: E731
    measuring = lambda: models.verify_points  # noqa: E731
    _, points = Scheduler().run_all([session, measuring], thread_context=torch.inference_mode())
    assert (tmp_path / "curve.json").is_file() and len(points) > 1
    assert shared == []
