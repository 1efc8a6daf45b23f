"""Bars of several `stack_ab.py` runs: each run's tokens per second in process and on each stack arm,
with the arms' ratio to the in-process engine written above their bars.

    python scripts/diagnostics/stack_ab_plot.py RUN_DIR [RUN_DIR ...] --out plot.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

IN_PROCESS = "in-process"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="stack_ab.py --out directories, in order")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--title", default="one session: the stack against the in-process engine")
    args = parser.parse_args()
    results = [json.loads((run / "result.json").read_text()) for run in args.runs]
    arms = [IN_PROCESS, *results[0]["arms"]]
    width = 0.8 / len(arms)
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(results), 3.6))
    for a, arm in enumerate(arms):
        xs = [i + (a - (len(arms) - 1) / 2) * width for i in range(len(results))]
        ys = [r[arm]["tokens_per_s"] for r in results]
        ax.bar(xs, ys, width, label=arm)
        if arm != IN_PROCESS:
            for x, y, r in zip(xs, ys, results, strict=True):
                ax.text(x, y, f"{r[arm]['vs_in_process']:.2f}x", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(results)), [f"run {i + 1}" for i in range(len(results))])
    ax.set_ylabel("tokens / s")
    ax.set_title(args.title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(args.out, dpi=130)
    print(args.out)


if __name__ == "__main__":
    main()
