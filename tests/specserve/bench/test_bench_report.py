from pathlib import Path

import pytest
from bench_fakes import FakeEngine

from specserve.bench.prompts import Prompt
from specserve.bench.report import format_table, plot
from specserve.bench.runner import run_bench
from specserve.core.request import GenerationRequest

PROMPTS = [
    Prompt(question_id=1, category="math", text="2+2?"),
    Prompt(question_id=2, category="writing", text="Diverge, please"),
]


@pytest.fixture(scope="module")
def result() -> dict:
    return run_bench(
        FakeEngine(),
        PROMPTS,
        ["target", "hf", "vanilla"],
        GenerationRequest.build(method="target", max_new_tokens=10),
        False,
    )


def test_table_has_one_row_per_method(result: dict) -> None:
    table = format_table(result)
    lines = table.splitlines()
    assert lines[0].split()[0] == "method"
    rows = {line.split()[0]: line for line in lines[2:]}
    assert list(rows) == ["target", "hf", "vanilla"]
    assert "1.00x" in rows["target"] and rows["target"].rstrip().endswith("2/2")
    assert rows["target"].split()[4] == "-"  # no acceptance rate without drafts
    assert "1.94x" in rows["hf"]  # (14 tokens / 0.072 s) / (14 / 0.14 s)
    assert rows["vanilla"].rstrip().endswith("1/2")
    assert len({len(line) for line in lines}) == 1  # aligned columns


def test_plot_writes_png(result: dict, tmp_path: Path) -> None:
    path = tmp_path / "bench.png"
    plot(result, path)
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(data) > 10_000


def test_plot_with_only_target(tmp_path: Path) -> None:
    only = run_bench(
        FakeEngine(), PROMPTS, ["target"], GenerationRequest.build(method="target", max_new_tokens=4), False
    )
    plot(only, tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 0
