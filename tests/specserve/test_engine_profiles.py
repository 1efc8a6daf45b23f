"""The engine on a model profile: it generates with the profile's installed target and draft, the draft in
the profile's dtype (where they are found and how they load: runtime/test_models.py).

Tiny models stand in for the Qwen checkpoints (installed into a temporary cache under the profiles'
directory names): what is tested is where the engine looks and how it loads, not the Qwen weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from specserve.core.request import GenerationRequest
from specserve.engine import Engine
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


def test_a_profile_serves_its_target_with_its_draft_in_bfloat16(
    tmp_path: Path, tiny_target_dir: Path, tiny_draft_dir: Path
) -> None:
    install_as(QWEN_1_5B, tiny_target_dir, tmp_path)
    draft_dir = install_as(QWEN_0_5B, tiny_draft_dir, tmp_path)
    # The profile's own choice is bf16 where this CPU has a bf16 kernel, else fp32
    # (tests/specserve/runtime/test_models.py); asked for, the draft runs in bf16 on any CPU.
    settings = EngineSettings(model=QWEN_1_5B, cache_dir=tmp_path, draft_dtype="bfloat16", weights="dense")
    engine = Engine(settings)
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
