"""Drafts trained for a model profile's target, shipped inside the package (`<profile>-<kind>`).

The GliDe draft was trained by `specserve train-draft`, then distilled further on the target's own
answers (`python -m specserve.training.distill`, see docs/training.md); the vanilla ablation by
`specserve train-draft` alone.

Each subdirectory is a draft saved by `specserve.glide.save_glide` or, for the hidden-state draft,
`specserve.eagle.model.save_eagle` (config.json + model.safetensors, bf16), with training.json (the
exact settings, data manifest and time) and training.png beside it. They are used only when the target
is their profile's own checkpoint (no --model-dir): a draft is trained for one target. Only the default
profile has shipped drafts so far.
The stopper directories hold the `decision` and `cost` policies' small MLP (model.safetensors +
stopper.json), one trained on each draft's own runs.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

from specserve.models.profiles import DEFAULT_PROFILE

SHIPPED_DIR = Path(__file__).resolve().parent
DEFAULT_TARGET = DEFAULT_PROFILE


class DraftKind(StrEnum):
    GLIDE = "glide"  # cross-attends to the target's KV
    VANILLA = "vanilla"  # the same block without cross-attention: the ablation
    EAGLE = "eagle"  # reads the target's final hidden states (specserve/eagle)


def shipped_draft_dir(kind: DraftKind, profile: str = DEFAULT_TARGET) -> Path | None:
    """The shipped draft for the named profile's target, or None when this build has none."""
    path = SHIPPED_DIR / f"{profile}-{kind.value}"
    return path if (path / "model.safetensors").is_file() else None


# The learned stopper of the `decision` and `cost` policies (`specserve train-stopper`), trained on the
# shipped GliDe draft's own runs for the default target; not a DraftKind because it drafts nothing.
STOPPER_DIR = SHIPPED_DIR / f"{DEFAULT_TARGET}-stopper"


# The drafts a stopper is trained on (`train-stopper --draft`); another draft's policy reads GliDe's.
STOPPER_DRAFTS = (DraftKind.GLIDE, DraftKind.EAGLE)


def stopper_dir(kind: DraftKind) -> Path:
    """Where the stopper trained on `kind`'s runs is shipped (`train-stopper --draft`): GliDe's is
    STOPPER_DIR, another draft's `<profile>-<kind>-stopper`."""
    return STOPPER_DIR if kind is DraftKind.GLIDE else SHIPPED_DIR / f"{DEFAULT_TARGET}-{kind.value}-stopper"
