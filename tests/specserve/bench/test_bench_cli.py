import argparse
import json
from pathlib import Path

import pytest
from bench_fakes import FakeEngine

from specserve.bench.cli import add_bench_parser, run_bench_command
from specserve.errors import InvalidArgument
from specserve.settings import EngineSettings


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="specserve")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "q.jsonl"
    rows = [
        {"question_id": 1, "category": "math", "turns": ["What is 2+2?"]},
        {"question_id": 2, "category": "coding", "turns": ["Diverge: write a loop"]},
        {"question_id": 3, "category": "coding", "turns": ["Write a function"]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class RecordingFactory:
    def __init__(self) -> None:
        self.engines: list[FakeEngine] = []

    def __call__(self, settings: EngineSettings) -> FakeEngine:
        self.engines.append(FakeEngine(settings))
        return self.engines[-1]


def test_defaults() -> None:
    args = parse()
    assert args.prompts is None and args.limit is None and args.out is None and args.plot is None
    assert args.methods == "target,hf,vanilla"
    assert (args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.seed) == (128, 0.0, 1.0, 0, 0)


def test_runs_prints_table_and_writes_files(
    prompts_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    args = parse(
        "--prompts", str(prompts_file), "--limit", "2", "--methods", "hf, vanilla",
        "--max-new-tokens", "6", "--seed", "7", "--out", str(out), "--plot", str(png), "--no-progress",
    )  # fmt: skip
    factory = RecordingFactory()
    assert run_bench_command(args, EngineSettings(), engine_factory=factory) == 0
    stdout = capsys.readouterr().out
    for method in ("target", "hf", "vanilla"):
        assert f"\n{method} " in stdout
    result = json.loads(out.read_text())
    assert result["config"]["methods"] == ["target", "hf", "vanilla"]
    assert result["config"]["target_auto_added"] is True
    assert result["config"]["limit"] == 2 and result["config"]["num_prompts"] == 2
    assert result["config"]["seed"] == 7 and result["config"]["max_new_tokens"] == 6
    assert result["config"]["allow_lossy"] is False
    assert result["config"]["prompts_file"] == str(prompts_file)
    assert result["methods"]["vanilla"]["identical_to_target"] == 1
    assert png.read_bytes().startswith(b"\x89PNG")
    assert len(factory.engines) == 1


def test_limit_applies_after_the_per_category_selection(tmp_path: Path) -> None:
    prompts_file = tmp_path / "q.jsonl"
    rows = [("coding", "Write a loop"), ("coding", "Write a class"), ("math", "What is 2+2?")]
    prompts_file.write_text(
        "".join(
            json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n"
            for i, (c, t) in enumerate(rows)
        )
    )
    args = parse(
        "--prompts", str(prompts_file), "--per-category", "1", "--limit", "2",
        "--methods", "hf", "--no-progress",
    )  # fmt: skip
    factory = RecordingFactory()
    assert run_bench_command(args, EngineSettings(), engine_factory=factory) == 0
    # One per category first (the loop, the sum), then the first two of those.
    ran = [prompt for prompt, method, _ in factory.engines[0].calls if method == "hf"]
    assert list(dict.fromkeys(ran)) == ["Write a loop", "What is 2+2?"]  # (a warm-up repeats one)


def test_allow_lossy_reaches_the_request(prompts_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    args = parse(
        "--prompts", str(prompts_file), "--methods", "hf", "--temperature", "0.7", "--allow-lossy",
        "--out", str(out), "--no-progress",
    )  # fmt: skip
    assert run_bench_command(args, EngineSettings(), engine_factory=RecordingFactory()) == 0
    assert json.loads(out.read_text())["config"]["allow_lossy"] is True


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--max-new-tokens", "0"], "max_new_tokens"),
        (["--methods", " , "], "--methods"),
        (["--limit", "0"], "--limit"),
        (["--out", "/nonexistent-dir/r.json"], "does not exist"),
        (["--plot", "/nonexistent-dir/r.png"], "does not exist"),
    ],
)
def test_bad_arguments_fail_before_loading_the_engine(
    prompts_file: Path, argv: list[str], message: str
) -> None:
    factory = RecordingFactory()
    with pytest.raises(InvalidArgument, match=message):
        run_bench_command(parse("--prompts", str(prompts_file), *argv), EngineSettings(), factory)
    assert factory.engines == []


def test_max_new_tokens_bounded_by_settings(prompts_file: Path) -> None:
    args = parse("--prompts", str(prompts_file), "--max-new-tokens", "200")
    with pytest.raises(InvalidArgument, match="max_new_tokens"):
        run_bench_command(args, EngineSettings(max_new_tokens_limit=100), RecordingFactory())


def test_unknown_method(prompts_file: Path) -> None:
    factory = RecordingFactory()
    args = parse("--prompts", str(prompts_file), "--methods", "hf,nope", "--no-progress")
    with pytest.raises(InvalidArgument, match="nope"):
        run_bench_command(args, EngineSettings(), factory)
    assert factory.engines[0].calls == []
