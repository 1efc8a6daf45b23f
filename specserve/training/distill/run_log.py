"""What a distillation run writes into its directory (`--out`), and the plot of its training log.

run.json              when the run starts: its kind, batch size and data (what training/budget.py reads)
training_log.jsonl    one JSON object a line: a window of steps' mean metrics, or a held-out evaluation
checkpoints/          step-NNNNNN/ every --checkpoint-every steps (training/checkpoint.py)
training.png          the log drawn, redrawn at every evaluation
model.safetensors, config.json   the finished draft
training.json         the finished run's summary: settings, device, data, time, size
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHECKPOINTS, LOG, SUMMARY = "checkpoints", "training_log.jsonl", "training.json"
RUN = "run.json"  # written when a run starts: its kind, batch size and data


def log_record(out: Path, record: dict[str, Any], message: str, log: Callable[[str], None]) -> None:
    """Says `message` and appends `record` to the run's training log (one JSON object a line)."""
    log(message)
    with open(out / LOG, "a") as f:
        f.write(json.dumps(record) + "\n")


def plot_training_log(out: Path) -> None:
    """training.png: loss, training agreement and held-out agreement over the steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in (out / LOG).read_text().splitlines() if line.strip()]
    train_r = [r for r in records if "loss" in r]
    eval_r = [r for r in records if "eval" in r]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    if train_r:
        a.plot([r["step"] for r in train_r], [r["loss"] for r in train_r], label="loss")
        a.plot([r["step"] for r in train_r], [r["kl"] for r in train_r], label="KL top-k")
        a.plot([r["step"] for r in train_r], [r["ce"] for r in train_r], label="CE argmax")
        a.legend()
        b.plot(
            [r["step"] for r in train_r],
            [r["accuracy"] for r in train_r],
            label="training batches",
            alpha=0.6,
        )
    a.set(xlabel="step", title="distillation loss")
    if eval_r:
        steps = [r["step"] for r in eval_r]
        b.plot(steps, [r["eval"]["overall"] for r in eval_r], "o-", label="held out (eval-draft)")
        b.plot(steps, [r["eval"]["by_lag"][0] for r in eval_r], "s--", label="held out, first token")
    b.set(xlabel="step", ylabel="top-1 agreement", title="agreement with the target")
    b.legend()
    fig.tight_layout()
    fig.savefig(out / "training.png", dpi=110)
    plt.close(fig)
