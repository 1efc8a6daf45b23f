"""Bars of several `specserve bench` results side by side: a group per run, a bar per method (tokens per
second), each bar's ratio to its run's `target` written above it. For A/B runs of two revisions or
settings, in the order they ran.

    python scripts/diagnostics/bench_runs_plot.py 'before 1=a.json' 'after 1=b.json' --out plot.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

TARGET = "target"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="LABEL=RESULTS.json", help="bench results, in order")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--title", default="tokens per second, runs side by side")
    args = parser.parse_args()
    runs = [(label, json.loads(Path(path).read_text())["methods"]) for label, path in _pairs(args.runs)]
    methods = list(dict.fromkeys(m for _, result in runs for m in result))
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(runs), 4.2))
    for i, method in enumerate(methods):
        xs = [g + (i - (len(methods) - 1) / 2) * width for g, (_, r) in enumerate(runs) if method in r]
        rates = [r[method]["tokens_per_s"] for _, r in runs if method in r]
        bars = ax.bar(xs, rates, width, label=method)
        for bar, (_, result) in zip(bars, [run for run in runs if method in run[1]], strict=True):
            if method != TARGET and TARGET in result:
                ratio = result[method]["tokens_per_s"] / result[TARGET]["tokens_per_s"]
                ax.annotate(
                    f"{ratio:.2f}x",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
    ax.set_xticks(range(len(runs)), [label for label, _ in runs], fontsize=8)
    ax.set_ylabel("tokens / s")
    ax.set_title(args.title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


def _pairs(specs: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for spec in specs:
        label, sep, path = spec.rpartition("=")
        if not sep:
            raise SystemExit(f"expected LABEL=RESULTS.json, got {spec!r}")
        pairs.append((label, path))
    return pairs


if __name__ == "__main__":
    main()
