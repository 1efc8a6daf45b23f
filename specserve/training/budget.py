"""The budget curve: held-out agreement against training token passes, for drafts of any kind.

A distillation run (`distill train`) logs `eval-draft`'s held-out agreement every `--eval-every` steps
and writes run.json when it starts (kind, batch size, data). The curve puts runs side by side on one
axis of compute: token passes = steps x batch x the mean answer tokens of a training sequence (batches
are seeded uniform draws, so that mean is what a step sees on average). Runs over the same features at
the same batch size compare at equal data and equal compute point by point; a run stopped early is a
shorter curve, not a different one.

    python -m specserve.training.budget runs/eagle runs/glide --png docs/draft_budget.png
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specserve.training.distill.run_log import LOG, RUN


@dataclass(frozen=True)
class BudgetPoint:
    step: int
    token_passes: int  # answer tokens the draft trained on up to this step
    first_token: float  # held-out agreement at the first draft token
    agreement: float  # mean over the 5 lags
    chain_of_4: float  # expected accepted tokens of a greedy chain of 4


@dataclass(frozen=True)
class BudgetRun:
    name: str
    kind: str
    points: tuple[BudgetPoint, ...]

    def at_passes(self, token_passes: int) -> BudgetPoint | None:
        """The last evaluation at or before `token_passes`, None if none is."""
        before = [p for p in self.points if p.token_passes <= token_passes]
        return before[-1] if before else None


def read_run(run: Path) -> BudgetRun:
    info = json.loads((run / RUN).read_text())
    tokens_per_step = info["batch_size"] * info["answer_tokens"] / max(info["sequences"], 1)
    records = [json.loads(line) for line in (run / LOG).read_text().splitlines() if line.strip()]
    points = {}  # step -> point: a resumed run may evaluate a step twice; the last one stands
    for record in records:
        if "eval" not in record:
            continue
        ev = record["eval"]
        points[record["step"]] = BudgetPoint(
            step=record["step"],
            token_passes=round(record["step"] * tokens_per_step),
            first_token=ev["by_lag"][0],
            agreement=ev["overall"],
            chain_of_4=ev["chain_accepted"]["4"],
        )
    return BudgetRun(run.name, info["kind"], tuple(points[s] for s in sorted(points)))


def plot_budget(runs: Sequence[BudgetRun], out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (first, chain) = plt.subplots(1, 2, figsize=(10, 3.8))
    for run in runs:
        passes = [p.token_passes / 1e6 for p in run.points]
        label = run.name if run.name == run.kind else f"{run.name} ({run.kind})"
        first.plot(passes, [p.first_token for p in run.points], "o-", label=label, markersize=3)
        chain.plot(passes, [p.chain_of_4 for p in run.points], "o-", label=label, markersize=3)
    first.set(xlabel="training token passes (millions)", ylabel="held-out agreement, first draft token")
    chain.set(xlabel="training token passes (millions)", ylabel="accepted tokens, greedy chain of 4")
    for ax in (first, chain):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("draft quality against training compute (eval-draft's 40 MT-Bench answers)")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def table(runs: Sequence[BudgetRun]) -> str:
    """Markdown: each run's evaluations at the token passes every run reached (equal compute)."""
    reached = min(run.points[-1].token_passes for run in runs)
    steps = sorted({p.token_passes for run in runs for p in run.points if p.token_passes <= reached})
    lines = ["| token passes | " + " | ".join(f"{r.name} first / chain of 4" for r in runs) + " |"]
    lines.append("|---" * (len(runs) + 1) + "|")
    for passes in steps:
        cells = []
        for run in runs:
            point = run.at_passes(passes)
            cells.append("-" if point is None else f"{point.first_token:.3f} / {point.chain_of_4:.2f}")
        lines.append(f"| {passes:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specserve.training.budget", description=__doc__)
    parser.add_argument("runs", type=Path, nargs="+", help="distillation run directories")
    parser.add_argument("--png", type=Path, required=True)
    args = parser.parse_args(argv)
    runs = [read_run(run) for run in args.runs]
    plot_budget(runs, args.png)
    print(table(runs))


if __name__ == "__main__":
    main()
