"""The learned stopper's files and the stop policies that need them: the `decision` and `cost` policies
read a DecisionModel, loaded here (safetensors + stopper.json) and handed to specserve.core.stopping,
which does no I/O."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from specserve.core import stopping
from specserve.core.decision import DecisionModel
from specserve.core.stopping import StopPolicy, StopPolicyName, StopSettings
from specserve.errors import NotFound

WEIGHTS_FILE = "model.safetensors"
RECORD_FILE = "stopper.json"


def save_decision_model(model: DecisionModel, directory: Path, record: dict) -> Path:
    """Writes model.safetensors and stopper.json (sizes plus `record`: AUC, data, settings)."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    save_file(tensors, str(directory / WEIGHTS_FILE))
    sizes = {"num_features": model.num_features, "hidden_size": model.hidden_size}
    (directory / RECORD_FILE).write_text(json.dumps({**sizes, **record}, indent=2) + "\n")
    return directory


@functools.lru_cache(maxsize=8)
def load_decision_model(directory: Path) -> DecisionModel:
    """Cached: every request's policy shares one read-only model."""
    weights, record_path = directory / WEIGHTS_FILE, directory / RECORD_FILE
    if not weights.is_file() or not record_path.is_file():
        raise NotFound(f"no stopper in {directory} (need {WEIGHTS_FILE} and {RECORD_FILE})")
    record = json.loads(record_path.read_text())
    model = DecisionModel(record["num_features"], record["hidden_size"])
    model.load_state_dict(load_file(str(weights)))
    model.positive_rate = float(record.get("train_positive_rate", 0.5))
    return model.eval().requires_grad_(False)


@functools.lru_cache(maxsize=8)
def shipped_decision_model(kind: str) -> DecisionModel:
    """The stopper trained on draft `kind`'s runs (specserve/drafts), else GliDe's, the default one: its
    features (entropy, top-10 probabilities) mean the same for any draft, only less exactly. Cached: every
    request's cost policy asks, and the answer never changes in a process."""
    from specserve.drafts import STOPPER_DIR, STOPPER_DRAFTS, DraftKind, stopper_dir

    directory = stopper_dir(DraftKind(kind)) if kind in STOPPER_DRAFTS else STOPPER_DIR  # a StrEnum: "eagle"
    return load_decision_model(directory if (directory / WEIGHTS_FILE).is_file() else STOPPER_DIR)


def make_stop_policy(name: str | StopPolicyName, settings: StopSettings | None = None) -> StopPolicy:
    """A fresh policy for `name`; a policy that reads the learned stopper and was given none gets the one
    shipped for the default model (specserve/drafts)."""
    settings = settings if settings is not None else StopSettings()
    if settings.decision_model is None and stopping.needs_decision_model(name, settings):
        from specserve.drafts import STOPPER_DIR

        settings = dataclasses.replace(settings, decision_model=load_decision_model(STOPPER_DIR))
    return stopping.make_stop_policy(name, settings)
