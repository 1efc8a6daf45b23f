"""Benchmark prompts in MT-Bench format: JSONL, one {"question_id", "category", "turns"} per line.

The method table uses only the first turn (the user message of a single-turn request), as Spec-Bench
does for its speed measurements; the multi-turn workload (bench/sessions.py) uses every turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specserve.bench.workloads import resolve_prompts_path
from specserve.core.constraint import Constraint, ConstraintKind
from specserve.errors import InvalidArgument
from specserve.grammar.schema import json_schema_constraint

_REQUIRED_KEYS = ("question_id", "category", "turns")


@dataclass(frozen=True)
class Prompt:
    question_id: int | str
    category: str
    text: str  # the first turn
    turns: tuple[str, ...] = ()  # every user turn, the first included
    # The schema its answer must follow (a workload line's "json_schema"), run as the request's constraint.
    constraint: Constraint | None = None


def load_prompts(path: Path | str | None = None, limit: int | None = None) -> list[Prompt]:
    """Read prompts from `path`: a file, a workload name (`grounded`, see workloads.py) or None for
    MT-Bench; keep the first `limit` if given.

    Every problem is an InvalidArgument with a one-line message naming the file (and line).
    """
    if limit is not None and limit < 1:
        raise InvalidArgument(f"--limit must be >= 1, got {limit}")
    path = resolve_prompts_path(path)
    try:
        content = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"cannot read prompts file {path}: {_one_line(e)}") from None

    prompts: list[Prompt] = []
    seen_ids: set[int | str] = set()
    for lineno, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue  # blank lines (e.g. a trailing newline pair) are harmless in JSONL
        prompt = _parse_line(line, f"{path}:{lineno}")
        if prompt.question_id in seen_ids:
            # Outputs are reported per question_id, so a duplicate would make them ambiguous.
            raise InvalidArgument(f"{path}:{lineno}: duplicate question_id {prompt.question_id!r}")
        seen_ids.add(prompt.question_id)
        prompts.append(prompt)
        if limit is not None and len(prompts) >= limit:
            break  # the rest of the file is not needed (nor validated)
    if not prompts:
        raise InvalidArgument(f"prompts file {path} contains no prompts")
    return prompts


def _parse_line(line: str, where: str) -> Prompt:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(obj, dict):
        raise InvalidArgument(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in _REQUIRED_KEYS if k not in obj]
    if missing:
        raise InvalidArgument(f"{where}: missing key(s) {', '.join(missing)}")
    qid, category, turns = obj["question_id"], obj["category"], obj["turns"]
    # bool is an int subclass; a true/false id is certainly a mistake.
    if isinstance(qid, bool) or not isinstance(qid, int | str):
        raise InvalidArgument(f"{where}: question_id must be an integer or a string")
    if not isinstance(category, str) or not category:
        raise InvalidArgument(f"{where}: category must be a non-empty string")
    if not isinstance(turns, list) or not turns:
        raise InvalidArgument(f"{where}: turns must be a non-empty list")
    for index, turn in enumerate(turns):
        if not isinstance(turn, str) or not turn.strip():
            which = "the first turn" if index == 0 else f"turn {index + 1}"
            raise InvalidArgument(f"{where}: {which} must be a non-empty string")
    return Prompt(
        question_id=qid,
        category=category,
        text=turns[0],
        turns=tuple(turns),
        constraint=_constraint(obj, where),
    )


def _constraint(obj: dict, where: str) -> Constraint | None:
    """A line's "json_schema" (a schema object), or its "constraint" ({"kind", "source"}), or None."""
    if "json_schema" in obj:
        if not isinstance(obj["json_schema"], dict):
            raise InvalidArgument(f"{where}: json_schema must be a JSON object")
        return json_schema_constraint(obj["json_schema"])
    if "constraint" in obj:
        spec = obj["constraint"]
        if not isinstance(spec, dict) or set(spec) != {"kind", "source"}:
            raise InvalidArgument(f'{where}: constraint must be {{"kind": ..., "source": ...}}')
        try:
            return Constraint(ConstraintKind(spec["kind"]), str(spec["source"]))
        except ValueError as e:
            raise InvalidArgument(f"{where}: {e}") from None
    return None


def _one_line(e: BaseException) -> str:
    # OSError's str() repeats the path we already name; its strerror is the useful part.
    text = getattr(e, "strerror", None) or str(e)
    return " ".join(text.split()) or type(e).__name__


def per_category(prompts: list[Prompt], count: int) -> list[Prompt]:
    """The first `count` prompts of every category, in file order: a short run that still covers all."""
    if count < 1:
        raise InvalidArgument(f"--per-category must be >= 1, got {count}")
    seen: dict[str, int] = {}
    kept = []
    for prompt in prompts:
        seen[prompt.category] = seen.get(prompt.category, 0) + 1
        if seen[prompt.category] <= count:
            kept.append(prompt)
    return kept
