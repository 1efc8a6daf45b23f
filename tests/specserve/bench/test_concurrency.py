"""`specserve bench --concurrency`: real engines (tiny random Llamas with the real tokenizer), sessions
run at once through continuous batching; figures, identity with the lowest level, the plot."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from specserve.bench.cli import add_bench_parser, run_bench_command
from specserve.bench.concurrency import parse_levels, percentile
from specserve.errors import InvalidArgument
from specserve.settings import EngineSettings


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="specserve")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


def test_levels_and_percentiles():
    assert parse_levels("8,1,4,4") == [1, 4, 8]
    for bad in ("", "a,b", "0", "1,999"):
        with pytest.raises(InvalidArgument):
            parse_levels(bad)
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0


def test_concurrency_bench_on_a_real_engine(tiny_target_dir, tiny_draft_dir, tmp_path: Path, capsys):
    prompts = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": "c", "turns": [f"Question number {i}?"]} for i in range(3)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    args = parse(
        "--prompts", str(prompts), "--methods", "vanilla", "--concurrency", "1,3,4",
        "--max-new-tokens", "12", "--ignore-eos", "--out", str(out), "--plot", str(png), "--no-progress",
    )  # fmt: skip
    settings = EngineSettings(model_dir=tiny_target_dir, draft_dir=tiny_draft_dir)
    assert run_bench_command(args, settings) == 0
    result = json.loads(out.read_text())
    by_method = result["concurrency"]["methods"]
    assert set(by_method) == {"target", "vanilla"}
    for method, levels in by_method.items():
        assert set(levels) == {"1", "3", "4"}
        for level, figures in levels.items():
            assert figures["tokens"] == 12 * int(level)
            assert figures["identical_to_lowest_level"], (method, level)
            assert figures["tokens_per_s"] > 0 and figures["ttft_p50_s"] > 0
            assert figures["itl_p99_s"] >= figures["itl_p50_s"]
    # batching: at 4 sessions the target carries several sessions' tokens per forward
    assert (
        by_method["target"]["4"]["target_tokens_per_forward"]
        > 2 * by_method["target"]["1"]["target_tokens_per_forward"] - 1
    )
    assert png.stat().st_size > 10_000
    assert "tok/s" in capsys.readouterr().out


def test_queued_requests_run_at_most_level_at_a_time(tiny_target_dir, tiny_draft_dir, tmp_path: Path):
    prompts = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": "c", "turns": [f"Question number {i}?"]} for i in range(5)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "c.json"
    args = parse(
        "--prompts", str(prompts), "--methods", "vanilla", "--concurrency", "1,2", "--requests", "5",
        "--max-new-tokens", "6", "--ignore-eos", "--out", str(out), "--no-progress",
    )  # fmt: skip
    settings = EngineSettings(model_dir=tiny_target_dir, draft_dir=tiny_draft_dir)
    assert run_bench_command(args, settings) == 0
    result = json.loads(out.read_text())
    assert result["config"]["requests"] == 5 and result["concurrency"]["requests"] == 5
    for method, levels in result["concurrency"]["methods"].items():
        for level, figures in levels.items():
            assert figures["tokens"] == 5 * 6  # every queued request, whatever the level
            assert figures["requests"] == 5 and figures["sessions"] == int(level)
            assert figures["identical_to_lowest_level"], (method, level)
    target = result["concurrency"]["methods"]["target"]
    # one at a time: 5 prefills + 5 x 5 decode steps; two at a time shares the decode steps
    assert target["1"]["target_forwards"] == 30
    assert target["2"]["target_forwards"] < 30
    with pytest.raises(InvalidArgument, match="requests"):
        run_bench_command(parse("--concurrency", "2", "--requests", "0", "--no-progress"), settings)


def test_in_process_methods_run_behind_the_llama_cpp_wrapper(tiny_target_dir, tiny_draft_dir):
    """With llama.cpp among the methods the bench wraps the engine (bench/llamacpp.WithLlamaCpp); the
    in-process methods beside it still batch on the engine inside."""
    from specserve.bench.concurrency import run_concurrency
    from specserve.bench.llamacpp import WithLlamaCpp
    from specserve.core.request import GenerationRequest
    from specserve.engine import Engine

    engine = Engine(EngineSettings(model_dir=tiny_target_dir, draft_dir=tiny_draft_dir))
    wrapped = WithLlamaCpp(engine, "smollm2-135m-instruct")
    try:
        request = GenerationRequest.build(method="target", max_new_tokens=6, ignore_eos=True)
        prompts = ["Question one?", "Question two?"]
        result = run_concurrency(wrapped, prompts, ["target"], [1, 2], request, progress=False)
    finally:
        wrapped.close()
    for level in ("1", "2"):
        assert result["methods"]["target"][level]["tokens"] == 6 * int(level)
