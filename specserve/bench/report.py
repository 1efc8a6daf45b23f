"""Human-readable views of a benchmark result: a text table and a PNG figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_COLUMNS = (
    "method",
    "tok/s",
    "speedup",
    "mean acc len",
    "accept rate",
    "draft/round",
    "verify/round",
    "identical",
)


def format_table(result: dict[str, Any]) -> str:
    """One row per method: tok/s, speedup vs target, mean accepted length, acceptance, identical/N."""
    rows = [_COLUMNS]
    for name, m in result["methods"].items():
        rows.append(
            (
                name,
                f"{m['tokens_per_s']:.2f}",
                _fmt(m["speedup_vs_target"], "{:.2f}x"),
                f"{m['mean_accepted_length']:.2f}",
                _fmt(m["acceptance_rate"], "{:.1%}"),
                _fmt(m.get("draft_cost_vs_target_step"), "{:.2f} step"),
                _fmt(m.get("verify_cost_vs_target_step"), "{:.2f} step"),
                f"{m['identical_to_target']}/{m['num_prompts']}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    # Method names left-aligned, numbers right-aligned so decimal points line up.
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path | str) -> None:
    """Write a PNG: tokens/s per method (speedup on each bar) and per-category speedup."""
    # Figure + FigureCanvasAgg instead of pyplot: no global backend switch, no GUI, thread-safe.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    methods = result["methods"]
    names = list(methods)
    fig = Figure(figsize=(max(8.0, 1.6 * len(names) + 6.0), 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax_tps, ax_cat = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 2]})

    tps = [methods[n]["tokens_per_s"] for n in names]
    bars = ax_tps.bar(names, tps, color=[f"C{i}" for i in range(len(names))])
    labels = [_fmt(methods[n]["speedup_vs_target"], "{:.2f}x") for n in names]
    ax_tps.bar_label(bars, labels=labels, padding=2)
    ax_tps.set_xticks(range(len(names)), names, rotation=35, ha="right")  # long names must not overlap
    ax_tps.set_ylabel("tokens / s")
    ax_tps.set_title("Throughput (label: speedup vs target)")
    ax_tps.margins(y=0.15)  # room for the labels above the tallest bar

    categories = list(dict.fromkeys(c for n in names for c in methods[n]["per_category"]))
    # The baseline is 1.0 everywhere by definition: the dashed line shows it, bars would be clutter.
    grouped = [n for n in names if n != "target"] or names
    width = 0.8 / len(grouped)
    for i, n in enumerate(grouped):
        per_cat = methods[n]["per_category"]
        speedups = [(per_cat.get(c) or {}).get("speedup_vs_target") or 0.0 for c in categories]
        xs = [k + (i - (len(grouped) - 1) / 2) * width for k in range(len(categories))]
        ax_cat.bar(xs, speedups, width, label=n, color=f"C{names.index(n)}")  # same colour as left
    ax_cat.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax_cat.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
    ax_cat.set_ylabel("speedup vs target")
    ax_cat.set_title("Speedup per category")
    ax_cat.margins(y=0.2)  # headroom so the one-row legend does not cover the tallest bars
    ax_cat.legend(fontsize="small", loc="upper center", ncols=len(grouped))

    cfg = result.get("config", {})
    fig.suptitle(
        f"{cfg.get('model', '?')}: max_new_tokens={cfg.get('max_new_tokens', '?')}, "
        f"temperature={cfg.get('temperature', '?')}, {cfg.get('num_prompts', '?')} prompts"
    )
    fig.savefig(path, format="png", dpi=120)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def verify_in_steps(verify_s: dict[int, float]) -> dict[int, float]:
    """verify_s(n) in one-token steps, verify_s(1) = 1: what decides whether a drafted token pays."""
    step = verify_s[min(verify_s)]
    return {n: seconds / step for n, seconds in sorted(verify_s.items())}


def plot_verify_curves(curves: dict[str, dict[int, float]], path: Path | str, max_nodes: int = 64) -> None:
    """One line per calibration: verify_s(n) / verify_s(1) against tree nodes n (single sessions only)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.2))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for label, verify_s in curves.items():
        steps = {n: s for n, s in verify_in_steps(verify_s).items() if n <= max_nodes}
        axes.plot(list(steps), list(steps.values()), marker="o", markersize=3, label=label)
    axes.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("tokens in one forward (tree nodes)")
    axes.set_ylabel("cost in one-token steps")
    axes.set_title("Target forward cost by tree size")
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
