"""`python -m specserve.training.distill` runs the package's commands: `curve` over finished runs prints
one point a run, in order of training data, and draws the plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specserve.training.distill.run_log import LOG, SUMMARY

# integration: starts the CLI in a process of its own; compute_only: no clock or port in it
pytestmark = [pytest.mark.integration, pytest.mark.compute_only]


def finished_run(directory: Path, fraction: float, answer_tokens: int, agreement: float) -> Path:
    """A run directory as `distill train` leaves it, with only what the curve reads."""
    directory.mkdir(parents=True)
    summary = {"settings": {"fraction": fraction}, "answer_tokens": answer_tokens}
    (directory / SUMMARY).write_text(json.dumps(summary))
    evaluation = {"overall": agreement, "by_lag": [0.4], "chain_accepted": {"4": 0.2}}
    records = [{"step": 10, "loss": 1.0}, {"step": 10, "eval": evaluation}]
    (directory / LOG).write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory


def test_the_curve_command_prints_a_point_per_run_in_order_of_data(tmp_path: Path) -> None:
    whole = finished_run(tmp_path / "f1.0", 1.0, 8000, 0.3)
    half = finished_run(tmp_path / "f0.5", 0.5, 4000, 0.25)
    png = tmp_path / "scaling.png"
    command = [sys.executable, "-m", "specserve.training.distill", "curve", str(whole), str(half)]
    done = subprocess.run(
        [*command, "--png", str(png)],
        capture_output=True,
        text=True,
        env=os.environ,
        timeout=300,
        check=True,
    )
    points = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(p["run"], p["answer_tokens"], p["agreement"]) for p in points] == [
        ("f0.5", 4000, 0.25),
        ("f1.0", 8000, 0.3),
    ]
    assert points[0] == {
        "run": "f0.5",
        "fraction": 0.5,
        "answer_tokens": 4000,
        "steps": 10,
        "agreement": 0.25,
        "first_token": 0.4,
        "chain_of_4": 0.2,
    }
    assert png.stat().st_size > 0


@pytest.mark.model
def test_features_of_the_files_own_weights_are_that_targets(generated: Path, tmp_path: Path) -> None:
    """`features --weights as-shipped` labels each position with the quantized target's own choice (a
    hidden-state draft serving beside that target reads its features): its top-1 is that target's
    argmax over the same tokens."""
    import numpy as np
    import torch

    from specserve.runtime.target_runtime import TargetRuntime
    from specserve.settings import EngineSettings

    out = tmp_path / "features"
    command = [sys.executable, "-m", "specserve.training.distill", "features", "--data", str(generated)]
    command += ["--out", str(out), "--weights", "as-shipped", "--top-k", "4", "--layers", "-1"]
    subprocess.run(command, capture_output=True, text=True, env=os.environ, timeout=600, check=True)
    shard = np.load(sorted(out.glob("*.npz"))[0])
    tokens, first = shard["tokens"], int(shard["lengths"][0])
    target = TargetRuntime(EngineSettings.from_env(weights="as-shipped")).target_model
    with torch.inference_mode():
        logits = target(torch.from_numpy(tokens[:first].astype(np.int64))[None]).logits[0]  # [L, V]
    np.testing.assert_array_equal(shard["topk_ids"][:first, 0], logits.argmax(-1).numpy())
