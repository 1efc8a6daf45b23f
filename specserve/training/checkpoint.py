"""Training checkpoints in safetensors (never pickle): the draft, the optimizer state, and where we were.

Layout of one checkpoint directory `step-000200/`:
  config.json + model.safetensors   the draft, loadable by `specserve.glide.load_glide`
  optimizer.safetensors             AdamW moments, keyed "<param index>.<name>"
  state.json                        step, epoch, batches consumed in that epoch, optimizer hyperparameters
A directory is written under a temporary name and renamed when complete, so a crash never leaves a
half checkpoint that resuming would trust.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from specserve.eagle.model import EagleDraft, save_eagle
from specserve.glide.model import GlideDraft, save_glide

STATE, OPTIMIZER = "state.json", "optimizer.safetensors"


def save_checkpoint(
    root: Path,
    model: GlideDraft | EagleDraft,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep: int = 2,
) -> Path:
    from safetensors.torch import save_file

    final = Path(root) / f"step-{state['step']:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(model, EagleDraft):
        save_eagle(model, tmp)
    else:
        save_glide(model, tmp)
    opt_state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for index, values in opt_state["state"].items():
        for name, value in values.items():
            key = f"{index}.{name}"
            if isinstance(value, torch.Tensor):
                tensors[key] = value.detach().contiguous().cpu()
            else:
                scalars[key] = value
    save_file(tensors, str(tmp / OPTIMIZER))
    full_state = {**state, "param_groups": opt_state["param_groups"], "optimizer_scalars": scalars}
    (tmp / STATE).write_text(json.dumps(full_state, indent=2) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in sorted(Path(root).glob("step-[0-9]*[0-9]"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(root: Path) -> Path | None:
    found = sorted(p for p in Path(root).glob("step-[0-9]*[0-9]") if (p / STATE).is_file())
    return found[-1] if found else None


def load_checkpoint(
    path: Path, model: GlideDraft | EagleDraft, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Restores weights and optimizer moments in place, on the device the model is on now (a checkpoint
    holds CPU copies, so a run may resume on another device); returns the saved state (step, epoch, ...)."""
    from safetensors.torch import load_file

    device = next(model.parameters()).device
    weights = load_file(str(Path(path) / "model.safetensors"), device=str(device))
    model.load_state_dict(weights, strict=True)
    state = json.loads((Path(path) / STATE).read_text())
    # Loaded on the CPU: `Optimizer.load_state_dict` moves each moment to its parameter's device and keeps
    # AdamW's step counter on the CPU, both where a run that never stopped keeps them.
    moments = load_file(str(Path(path) / OPTIMIZER))
    per_param: dict[int, dict[str, Any]] = {}
    for key, value in moments.items():
        index, name = key.split(".", 1)
        per_param.setdefault(int(index), {})[name] = value
    for key, value in state.pop("optimizer_scalars").items():
        index, name = key.split(".", 1)
        per_param.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": per_param, "param_groups": state.pop("param_groups")})
    return state
