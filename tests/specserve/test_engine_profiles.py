"""The engine on a model profile: the target and its draft come from the profile's installed checkpoints,
the draft in the profile's dtype, and an uninstalled one says how to install it.

Tiny models stand in for the Qwen checkpoints (installed into a temporary cache under the profiles'
directory names): what is tested is where the engine looks and how it loads, not the Qwen weights.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from specserve.core.request import GenerationRequest
from specserve.engine import Engine
from specserve.errors import FailedPrecondition
from specserve.methods import Method
from specserve.models.default_model import COMPLETE_MARKER
from specserve.models.profiles import model_profile
from specserve.settings import EngineSettings

QWEN_1_5B, QWEN_0_5B = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
PROMPT = "Write a haiku about caches."


def install_as(profile: str, checkpoint: Path, cache_dir: Path) -> Path:
    """`checkpoint` where `specserve models install` would have put the profile's."""
    dest = cache_dir / "models" / model_profile(profile).cache_name
    shutil.copytree(checkpoint, dest)
    (dest / COMPLETE_MARKER).write_text("{}\n")
    return dest


def test_an_uninstalled_target_names_its_install_command(tmp_path: Path) -> None:
    engine = Engine(EngineSettings(model=QWEN_1_5B, cache_dir=tmp_path))
    with pytest.raises(FailedPrecondition, match=re.escape(f"`specserve models install {QWEN_1_5B}`")):
        _ = engine.model_dir


def test_an_uninstalled_draft_names_its_install_command(tmp_path: Path, tiny_target_dir: Path) -> None:
    install_as(QWEN_1_5B, tiny_target_dir, tmp_path)
    engine = Engine(EngineSettings(model=QWEN_1_5B, cache_dir=tmp_path))
    assert engine.model_dir == tmp_path / "models" / "Qwen2.5-Coder-1.5B-Instruct"
    with pytest.raises(FailedPrecondition, match=re.escape(f"`specserve models install {QWEN_0_5B}`")):
        _ = engine.draft_model_dir


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
def test_the_draft_dtype(overrides: dict, draft_dtype: str) -> None:
    settings = EngineSettings(**{"model": QWEN_1_5B, **overrides})
    assert Engine(settings).draft_dtype == draft_dtype


def test_a_profile_serves_its_target_with_its_draft_in_bfloat16(
    tmp_path: Path, tiny_target_dir: Path, tiny_draft_dir: Path
) -> None:
    install_as(QWEN_1_5B, tiny_target_dir, tmp_path)
    draft_dir = install_as(QWEN_0_5B, tiny_draft_dir, tmp_path)
    engine = Engine(EngineSettings(model=QWEN_1_5B, cache_dir=tmp_path))
    assert engine.draft_model_dir == draft_dir
    target = engine.generate(PROMPT, GenerationRequest.build(method=Method.TARGET, max_new_tokens=16))
    vanilla = engine.generate(PROMPT, GenerationRequest.build(method=Method.VANILLA, max_new_tokens=16))
    draft = engine.vanilla_draft_runner.model
    assert draft.dtype == torch.bfloat16 and engine.target_model.dtype == torch.float32
    assert draft.config.hidden_size == 32  # the tiny draft, not the target's first layers
    assert vanilla.token_ids == target.token_ids  # lossless: the target verifies in float32
    assert vanilla.stats.num_draft_tokens > 0
    # Sampling mixes the draft's bfloat16 probabilities with the target's float32 ones.
    sampled = GenerationRequest.build(method=Method.VANILLA_TREE, temperature=0.8, seed=1, max_new_tokens=16)
    assert engine.generate(PROMPT, sampled).token_ids == engine.generate(PROMPT, sampled).token_ids
