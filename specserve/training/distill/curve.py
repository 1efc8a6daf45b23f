"""The data-scaling curve: the final held-out agreement of finished runs that differ only in `--fraction`
(`distill curve`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specserve.training.distill.run_log import LOG, SUMMARY


def scaling_curve(runs: Sequence[Path], out_png: Path) -> list[dict[str, Any]]:
    """Final held-out agreement of runs that differ only in `fraction`: a table (returned) and a plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = []
    for run in runs:
        summary = json.loads((Path(run) / SUMMARY).read_text())
        records = [json.loads(x) for x in (Path(run) / LOG).read_text().splitlines() if x.strip()]
        final = [r for r in records if "eval" in r][-1]
        points.append(
            {
                "run": Path(run).name,
                "fraction": summary["settings"]["fraction"],
                "answer_tokens": summary["answer_tokens"],
                "steps": final["step"],
                "agreement": final["eval"]["overall"],
                "first_token": final["eval"]["by_lag"][0],
                "chain_of_4": final["eval"]["chain_accepted"]["4"],
            }
        )
    points.sort(key=lambda p: p["answer_tokens"])
    fig, ax = plt.subplots(figsize=(6, 3.8))
    tokens = [p["answer_tokens"] for p in points]
    ax.plot(tokens, [p["first_token"] for p in points], "s-", label="first draft token")
    ax.plot(tokens, [p["agreement"] for p in points], "o-", label="all 5 draft tokens")
    ax.set(xscale="log", xlabel="self-distillation answer tokens (log)", ylabel="held-out agreement")
    ax.set_title(f"data scaling at a fixed budget ({points[0]['steps']} steps)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return points
