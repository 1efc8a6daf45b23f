"""The budget curve reads runs as `distill train` writes them and compares them at equal token passes."""

from __future__ import annotations

import json
from pathlib import Path

from specserve.training.budget import main, read_run, table
from specserve.training.distill.run_log import LOG, RUN


def write_run(root: Path, name: str, kind: str, batch_size: int, evals: dict[int, float]) -> Path:
    run = root / name
    run.mkdir()
    info = {"kind": kind, "batch_size": batch_size, "steps": 1000, "sequences": 100, "answer_tokens": 15000}
    (run / RUN).write_text(json.dumps(info))
    lines = []
    for step, first in evals.items():
        lines.append(json.dumps({"step": step, "loss": 1.0}))  # training records are skipped
        by_lag = [first, first / 2, 0.1, 0.1, 0.1]
        ev = {"overall": sum(by_lag) / 5, "by_lag": by_lag, "chain_accepted": {"4": first * 2}}
        lines.append(json.dumps({"step": step, "eval": ev}))
    (run / LOG).write_text("\n".join(lines) + "\n")
    return run


def test_token_passes_are_steps_times_batch_times_mean_answer_length(tmp_path: Path) -> None:
    run = read_run(write_run(tmp_path, "e", "eagle", 8, {0: 0.1, 100: 0.4, 200: 0.5}))
    # 150 answer tokens per sequence on average, 8 sequences a step
    assert [p.token_passes for p in run.points] == [0, 120_000, 240_000]
    assert [p.first_token for p in run.points] == [0.1, 0.4, 0.5]
    assert run.points[1].chain_of_4 == 0.8
    assert run.at_passes(239_999) == run.points[1]
    assert run.at_passes(-1) is None


def test_a_resumed_runs_repeated_evaluation_counts_once(tmp_path: Path) -> None:
    path = write_run(tmp_path, "g", "glide", 8, {0: 0.1, 100: 0.2})
    with open(path / LOG, "a") as f:  # resumed at step 100 and evaluated again
        f.write(
            json.dumps(
                {"step": 100, "eval": {"overall": 0.3, "by_lag": [0.3] * 5, "chain_accepted": {"4": 1}}}
            )
        )
    run = read_run(path)
    assert [p.step for p in run.points] == [0, 100] and run.points[-1].first_token == 0.3


def test_the_table_stops_where_the_shorter_run_stopped(tmp_path: Path, capsys) -> None:
    long = write_run(tmp_path, "long", "eagle", 8, {0: 0.1, 100: 0.4, 200: 0.5, 300: 0.55})
    short = write_run(tmp_path, "short", "glide", 8, {0: 0.1, 100: 0.2, 200: 0.25})
    rows = table([read_run(long), read_run(short)]).splitlines()
    assert len(rows) == 2 + 3  # header, rule, 0 / 120k / 240k passes: never 360k, which only one reached
    assert rows[-1] == "| 240,000 | 0.500 / 1.00 | 0.250 / 0.50 |"
    main([str(long), str(short), "--png", str(tmp_path / "budget.png")])
    assert (tmp_path / "budget.png").stat().st_size > 0
    assert "240,000" in capsys.readouterr().out
