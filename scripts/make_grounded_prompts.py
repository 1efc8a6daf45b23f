"""Writes specserve/bench/data/grounded.jsonl, the `grounded` benchmark workload (`specserve bench
--prompts grounded`): requests whose answer is largely in the prompt, as people send them to a served
model, so drafting from the prompt itself (suffix trees, prompt lookup) pays.

Four categories of 8 prompts, in MT-Bench format (one {"question_id", "category", "turns", "source"}
object per line; `source` names the module and object quoted, `module:Class.method`):
- `code-edit`: a function or method, then an edit (rename a parameter or local variable, add type
  hints, add a docstring, add comments); "show the whole updated function";
- `extraction`: list every call / `self` attribute / exception / parameter and local variable of a
  function, one per line, quoted as written;
- `summary`: summarise a passage of reference prose (a module's, class's or function's docstring);
- `code-explanation`: explain a function, quoting the lines explained.

Sources: the running interpreter's standard library (`sysconfig.get_paths()["stdlib"]`, the files
`specserve.training.corpus.stdlib_files` lists), read with `ast`, never imported. Functions are
top-level functions or methods of top-level classes (no closures), 12-45 lines with decorators, with a
docstring, ASCII only, no tabs. Passages are docstrings cut at a paragraph boundary to 600-2,600
characters that read as prose (sentences, few symbols, no doctests). Every prompt is 600-3,500
characters (the model's prompt bound is 1,536 tokens); at most two prompts quote one module, and a
category quotes a module once.

Excluded: every module in `specserve.bench.workloads.EXCLUDED_MODULES`, the standard-library modules
the self-distillation training data draws on (its docstring prompts and stdlib corpus documents, and
`pydoc_data.topics`, whose every topic the training prompts ask about), so the workload measures
drafting on text the shipped drafts were not trained on. `--derive-exclusions` prints that list
afresh from `specserve.training.prompt_set` and `specserve.training.corpus`. The training's other
sources (prompts written for the project, FastChat's dummy conversations, the target's own
self-instruct requests) quote no standard-library module. The `pydoc` corpus (Debian's python3.11-doc
reST sources, used only where installed) is prose about modules, neither their code nor their
docstrings, and is not considered.

Deterministic: a fixed seed, sorted file and candidate lists, no dependence on set or dict order, the
time or the environment. The shipped file was written by CPython 3.11.7 (`GROUNDED_PYTHON` in
workloads.py); another minor version has another standard library, and so other prompts.

    .venv/bin/python scripts/make_grounded_prompts.py                 # rewrite the shipped file
    .venv/bin/python scripts/make_grounded_prompts.py --check         # exit 1 if it is out of date
    .venv/bin/python scripts/make_grounded_prompts.py --out FILE      # write elsewhere
    .venv/bin/python scripts/make_grounded_prompts.py --derive-exclusions
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import sys
import sysconfig
import textwrap
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from specserve.bench.workloads import EXCLUDED_MODULES, GROUNDED_PATH, GROUNDED_PYTHON

SEED = 20_251_122
PER_CATEGORY = 8
MIN_CHARS, MAX_CHARS = 600, 3_500
MIN_LINES, MAX_LINES = 12, 45
PASSAGE_MIN_CHARS, PASSAGE_MAX_CHARS = 600, 2_600
PASSAGE_MIN_SENTENCES, PASSAGE_MIN_PROSE = 5, 0.88  # prose: letters and spaces, of all characters
MAX_PER_MODULE = 2

# The training data's defaults (see specserve/training): the largest of each, a prefix of the others.
TRAINING_SEED = 0
TRAINING_DOCSTRINGS = 3_000  # prompt_set.docstrings_set's default; generation's CLI uses 1,500
TRAINING_STDLIB_CHARS = 400_000  # DataSettings.stdlib_chars; the training CLI's default is 250,000

# Names a renamed identifier may take (the first one the function does not already use).
NEW_NAMES = ["value", "item", "entry", "current", "payload", "subject", "operand", "record"]


# --- sources -----------------------------------------------------------------------------------------


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def module_name(path: Path, root: Path) -> str:
    """Lib/email/mime/text.py -> email.mime.text; Lib/xml/__init__.py -> xml."""
    return ".".join(p for p in path.relative_to(root).with_suffix("").parts if p != "__init__")


def source_files() -> list[tuple[str, Path]]:
    """(module, path) of every standard-library file the training corpus could read, by module name."""
    from specserve.training.corpus import stdlib_files

    root = stdlib_root()
    return sorted((module_name(p, root), p) for p in stdlib_files())


@dataclass(frozen=True)
class Function:
    module: str
    qualname: str  # name or Class.name
    file: str  # Lib/...
    code: str  # dedented, decorators included
    code_without_docstring: str
    params: tuple[str, ...]  # without self / cls
    annotated: bool
    calls: tuple[str, ...]  # distinct callees as written (`self._fix`, `os.path.join`), in order
    self_attributes: tuple[str, ...]  # `self.x`, in order
    exceptions: tuple[str, ...]  # raised or caught, in order
    locals: tuple[str, ...]  # assigned names that are not parameters, in order
    branches: int  # if / for / while statements
    rename: tuple[str, str] | None  # (kind, name) a whole-word rename can safely change

    @property
    def source(self) -> str:
        return f"{self.module}:{self.qualname}"


@dataclass(frozen=True)
class Passage:
    module: str
    qualname: str  # "" for a module docstring
    file: str
    kind: str  # "module", "class" or "function"
    text: str

    @property
    def source(self) -> str:
        return f"{self.module}:{self.qualname}" if self.qualname else self.module


def _unique(items: Iterator[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))  # first occurrences, in order


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else None
    return None


def _exception_names(node: ast.expr | None) -> Iterator[str]:
    if node is None:
        return
    if isinstance(node, ast.Tuple):
        for element in node.elts:
            yield from _exception_names(element)
        return
    if isinstance(node, ast.Call):
        node = node.func
    name = _dotted(node)
    if name and name.split(".")[-1][:1].isupper():  # a class, not `raise exc` of a variable
        yield name


def _analyse(func: ast.FunctionDef | ast.AsyncFunctionDef, code: str) -> dict:
    args = func.args
    all_args = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    all_args += [a for a in (args.vararg, args.kwarg) if a is not None]
    params = tuple(a.arg for a in all_args if a.arg not in ("self", "cls"))
    annotated = func.returns is not None or any(a.annotation is not None for a in all_args)
    walked = list(ast.walk(func))
    nodes = sorted(
        (n for n in walked if hasattr(n, "lineno")), key=lambda n: (n.lineno, n.col_offset, type(n).__name__)
    )
    calls = _unique(name for n in nodes if isinstance(n, ast.Call) and (name := _dotted(n.func)))
    self_attributes = _unique(
        f"self.{n.attr}"
        for n in nodes
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
    )
    exceptions: list[str] = []
    for n in nodes:
        if isinstance(n, ast.Raise):
            exceptions += _exception_names(n.exc)
        elif isinstance(n, ast.ExceptHandler):
            exceptions += _exception_names(n.type)
    stored = _unique(
        n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and n.id not in params
    )
    uses = Counter(n.id for n in nodes if isinstance(n, ast.Name))
    for a in all_args:
        uses[a.arg] += 1
    rename = None
    for name in sorted(uses, key=lambda k: (-uses[k], k)):
        if name in ("self", "cls") or (name not in params and name not in stored) or uses[name] < 3:
            continue
        # Every textual occurrence is one of these names: none in a string, comment, keyword or attribute.
        if len(re.findall(rf"(?<![\w.]){re.escape(name)}\b", code)) == uses[name] and not re.search(
            rf"\.{re.escape(name)}\b", code
        ):
            rename = ("parameter" if name in params else "local variable", name)
            break
    branches = sum(isinstance(n, ast.If | ast.For | ast.While) for n in walked)
    return {
        "params": params,
        "annotated": annotated,
        "calls": calls,
        "self_attributes": self_attributes,
        "exceptions": _unique(iter(exceptions)),
        "locals": stored,
        "branches": branches,
        "rename": rename,
    }


def _definitions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Top-level functions and methods of top-level classes (qualname, node), in file order."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                    yield f"{node.name}.{sub.name}", sub


def _functions(module: str, file: str, source: str, tree: ast.Module) -> Iterator[Function]:
    lines = source.splitlines()
    for qualname, node in _definitions(tree):
        start = min([d.lineno for d in node.decorator_list] + [node.lineno])
        end = node.end_lineno or node.lineno
        doc = ast.get_docstring(node)
        if not (MIN_LINES <= end - start + 1 <= MAX_LINES) or not doc:
            continue
        chunk = lines[start - 1 : end]
        code = textwrap.dedent("\n".join(chunk))
        if not code.isascii() or "\t" in code:
            continue
        doc_node = node.body[0]
        doc_end = doc_node.end_lineno or doc_node.lineno
        if (doc_end - doc_node.lineno + 1) * 2 > len(chunk) or len(node.body) < 2:
            continue  # mostly docstring: little code to work with
        kept = chunk[: doc_node.lineno - start] + chunk[doc_end - start + 1 :]
        code_without_docstring = textwrap.dedent("\n".join(kept))
        yield Function(
            module, qualname, file, code, code_without_docstring, **_analyse(node, "\n".join(chunk))
        )


def _passage(doc: str) -> str | None:
    """The docstring's leading paragraphs, up to PASSAGE_MAX_CHARS; None unless they are prose."""
    paragraphs = [p.strip("\n") for p in re.split(r"\n\s*\n", doc.strip()) if p.strip()]
    text = ""
    for paragraph in paragraphs:
        candidate = f"{text}\n\n{paragraph}" if text else paragraph
        if len(candidate) > PASSAGE_MAX_CHARS:
            break
        text = candidate
    if len(text) < PASSAGE_MIN_CHARS or not text.isascii() or "\t" in text:
        return None
    lines = [line for line in text.splitlines() if line.strip()]
    doctest = sum(line.lstrip().startswith((">>>", "...")) for line in lines)
    sentences = len(re.findall(r"[a-z][.!?](?:\s|$)", text))
    prose = sum(c.isalpha() or c == " " for c in text) / len(text)
    if doctest * 10 > len(lines) or sentences < PASSAGE_MIN_SENTENCES or prose < PASSAGE_MIN_PROSE:
        return None  # tables, code, doctests
    return text


def _passages(module: str, file: str, tree: ast.Module) -> Iterator[Passage]:
    doc = ast.get_docstring(tree)
    if doc and (text := _passage(doc)):
        yield Passage(module, "", file, "module", text)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and (doc := ast.get_docstring(node)) and (text := _passage(doc)):
            yield Passage(module, node.name, file, "class", text)
    for qualname, func in _definitions(tree):
        if (doc := ast.get_docstring(func)) and (text := _passage(doc)):
            yield Passage(module, qualname, file, "function", text)


def candidates() -> tuple[list[Function], list[Passage]]:
    """Every usable function and passage of the modules not excluded, sorted by source."""
    root = stdlib_root()
    functions: list[Function] = []
    passages: list[Passage] = []
    for module, path in source_files():
        if module in EXCLUDED_MODULES:
            continue
        source = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            continue  # e.g. lib2to3's Python 2 test data
        file = f"Lib/{path.relative_to(root).as_posix()}"
        functions += _functions(module, file, source, tree)
        passages += _passages(module, file, tree)
    functions.sort(key=lambda f: f.source)
    passages.sort(key=lambda p: p.source)
    return functions, passages


# --- prompts -------------------------------------------------------------------------------------------


def _where(f: Function) -> str:
    if "." in f.qualname:
        cls, name = f.qualname.split(".", 1)
        return f"the method `{name}` of class `{cls}` in Python's `{f.file}`"
    return f"the function `{f.qualname}` from Python's `{f.file}`"


def _block(code: str) -> str:
    return f"```python\n{code}\n```"


def _new_name(f: Function, rng: random.Random) -> str | None:
    names = NEW_NAMES[:]
    rng.shuffle(names)
    return next((n for n in names if not re.search(rf"\b{n}\b", f.code)), None)


# A prompt builder returns None when the function does not suit it.
Builder = Callable[[Function, random.Random], str | None]


def _edit_rename(f: Function, rng: random.Random) -> str | None:
    if f.rename is None or not (new := _new_name(f, rng)):
        return None
    kind, old = f.rename
    return (
        f"Here is {_where(f)}:\n\n{_block(f.code)}\n\nRename the {kind} `{old}` to `{new}` everywhere in "
        "it, changing nothing else. Show the whole updated function."
    )


def _edit_type_hints(f: Function, rng: random.Random) -> str | None:
    if f.annotated or not f.params:
        return None
    return (
        f"Here is {_where(f)}:\n\n{_block(f.code)}\n\nAdd type hints to every parameter and to the return "
        "value, keeping the code and the docstring as they are. Show the whole updated function."
    )


def _edit_docstring(f: Function, rng: random.Random) -> str | None:
    return (
        f"Here is {_where(f)}, without its docstring:\n\n{_block(f.code_without_docstring)}\n\nAdd a "
        "docstring that says what it does, what each parameter means and what it returns, changing "
        "nothing else. Show the whole updated function."
    )


def _edit_comments(f: Function, rng: random.Random) -> str | None:
    if f.branches < 2:
        return None
    return (
        f"Here is {_where(f)}:\n\n{_block(f.code)}\n\nAdd a short comment above every `if`, `for` and "
        "`while` statement saying what it checks or loops over, changing nothing else. Show the whole "
        "updated function."
    )


def _extract_calls(f: Function, rng: random.Random) -> str | None:
    if len(f.calls) < 4:
        return None
    return (
        f"From the following code ({_where(f)}), list every function or method it calls, one per line, "
        f"quoting each exactly as written in the code (such as `{f.calls[0]}`).\n\n{_block(f.code)}"
    )


def _extract_self(f: Function, rng: random.Random) -> str | None:
    if len(f.self_attributes) < 3:
        return None
    return (
        f"From the following method ({_where(f)}), list every attribute of `self` it reads, sets or "
        "calls, one per line, quoting each as written (`self.name`), and say after each whether it is "
        f"read, set or called.\n\n{_block(f.code)}"
    )


def _extract_exceptions(f: Function, rng: random.Random) -> str | None:
    if len(f.exceptions) < 2:
        return None
    return (
        f"From the following code ({_where(f)}), list every exception class it raises or catches, one "
        "per line, quoting each name as written, and say after each whether it is raised or caught and "
        f"on which condition.\n\n{_block(f.code)}"
    )


def _extract_names(f: Function, rng: random.Random) -> str | None:
    if len(f.params) < 2 or len(f.locals) < 3:
        return None
    return (
        f"From the following function ({_where(f)}), list every parameter and every local variable it "
        "assigns, one per line, quoting each name as written and marking it `parameter` or `local`.\n\n"
        f"{_block(f.code)}"
    )


def _explain_steps(f: Function, rng: random.Random) -> str | None:
    return (
        f"Explain what the following code ({_where(f)}) does, step by step. Before each explanation, "
        f"quote the line or lines it explains in backticks.\n\n{_block(f.code)}"
    )


def _explain_walkthrough(f: Function, rng: random.Random) -> str | None:
    return (
        f"Walk me through {_where(f)}. Quote each line you explain exactly as it appears, then say what "
        f"it does and why.\n\n{_block(f.code)}"
    )


def _explain_confused(f: Function, rng: random.Random) -> str | None:
    return (
        f"I'm reading {_where(f)} and don't follow it:\n\n{_block(f.code)}\n\nExplain it by quoting its "
        "key lines one at a time and saying what each one does."
    )


def _explain_control_flow(f: Function, rng: random.Random) -> str | None:
    if f.branches < 2:
        return None
    return (
        f"Explain the control flow of {_where(f)}: for every `if`, loop, `return` and `raise`, quote the "
        f"line and say when it is reached.\n\n{_block(f.code)}"
    )


def _passage_where(p: Passage) -> str:
    if p.kind == "module":
        return f"the documentation of Python's `{p.file}` module"
    if p.kind == "function" and "." in p.qualname:
        cls, name = p.qualname.split(".", 1)
        return f"the docstring of the method `{name}` of class `{cls}` in Python's `{p.file}`"
    return f"the docstring of the {p.kind} `{p.qualname}` in Python's `{p.file}`"


SummaryBuilder = Callable[[Passage], str]

SUMMARIES: list[SummaryBuilder] = [
    lambda p: (
        f"Summarize the following passage from {_passage_where(p)} in three to five sentences.\n\n{p.text}"
    ),
    lambda p: (
        f"Read the following text ({_passage_where(p)}) and summarize its main points as a "
        f"bulleted list, keeping the technical terms it uses.\n\n{p.text}"
    ),
    lambda p: (
        f"Write a one-paragraph summary of the following text for a programmer who has not read "
        f"it, then a one-sentence summary. It is {_passage_where(p)}.\n\n{p.text}"
    ),
    lambda p: (
        f"Here is {_passage_where(p)}:\n\n{p.text}\n\nSummarize it: what it describes, what it "
        "says to use or avoid, and any names it defines, in a short paragraph each."
    ),
]

FUNCTION_CATEGORIES: dict[str, list[Builder]] = {
    "code-edit": [_edit_rename, _edit_type_hints, _edit_docstring, _edit_comments],
    "extraction": [_extract_calls, _extract_self, _extract_exceptions, _extract_names],
    "code-explanation": [_explain_steps, _explain_walkthrough, _explain_confused, _explain_control_flow],
}
CATEGORIES = ["code-edit", "extraction", "summary", "code-explanation"]


@dataclass
class _Selection:
    per_module: Counter[str] = field(default_factory=Counter)
    used: set[str] = field(default_factory=set)

    def allows(self, module: str, source: str, category_modules: set[str]) -> bool:
        return (
            source not in self.used
            and self.per_module[module] < MAX_PER_MODULE
            and module not in category_modules
        )

    def take(self, module: str, source: str, category_modules: set[str]) -> None:
        self.used.add(source)
        self.per_module[module] += 1
        category_modules.add(module)


def _fits(text: str | None) -> bool:
    return text is not None and MIN_CHARS <= len(text) <= MAX_CHARS


def build_records() -> list[dict]:
    """The workload's records, in file order: category by category, 8 each."""
    rng = random.Random(SEED)
    functions, passages = candidates()
    rng.shuffle(functions)
    rng.shuffle(passages)
    selection = _Selection()
    records = []
    for category in CATEGORIES:
        modules: set[str] = set()
        for i in range(PER_CATEGORY):
            text, source = _pick(category, i, functions, passages, selection, modules, rng)
            records.append(
                {
                    "question_id": f"grounded-{category}-{i + 1:02d}",
                    "category": category,
                    "turns": [text],
                    "source": source,
                }
            )
    return records


def _pick(
    category: str,
    i: int,
    functions: list[Function],
    passages: list[Passage],
    selection: _Selection,
    modules: set[str],
    rng: random.Random,
) -> tuple[str, str]:
    if category == "summary":
        summarise = SUMMARIES[i % len(SUMMARIES)]
        for p in passages:
            if selection.allows(p.module, p.source, modules) and _fits(text := summarise(p)):
                selection.take(p.module, p.source, modules)
                return text, p.source
    else:
        builders = FUNCTION_CATEGORIES[category]
        build = builders[i % len(builders)]
        for f in functions:
            if selection.allows(f.module, f.source, modules) and _fits(text := build(f, rng)):
                selection.take(f.module, f.source, modules)
                assert text is not None
                return text, f.source
    raise SystemExit(f"no source left for {category} prompt {i + 1}: relax the limits")


def render(records: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=True) + "\n" for r in records)


# --- what the training data draws on -------------------------------------------------------------------


def training_modules() -> list[str]:
    """The standard-library modules the self-distillation training data draws on, with its defaults."""
    from specserve.training import prompt_set
    from specserve.training.corpus import Source, read_documents

    files = source_files()
    modules = {m for m, _ in files}
    drawn: set[str] = set()

    # stdlib corpus documents: whole files (the last one cut short), matched back to their files.
    # Files with the same text (empty packages' __init__.py, say) all count.
    by_text: dict[str, set[str]] = {}
    for module, path in files:
        by_text.setdefault(path.read_text(encoding="utf-8", errors="replace"), set()).add(module)
    for text in read_documents(Source.STDLIB, TRAINING_STDLIB_CHARS, TRAINING_SEED):
        drawn.update(by_text.get(text) or {m for t, ms in by_text.items() if t.startswith(text) for m in ms})

    # docstring prompts: each quotes its docstring after a blank line or names its object (`json.dumps`).
    names_by_doc: dict[str, set[str]] = {}
    for name, doc in prompt_set._stdlib_docstrings():
        names_by_doc.setdefault(doc.strip(), set()).add(name)

    def module_of(dotted: str) -> str:
        parts = dotted.split(".")
        return next(m for k in range(len(parts), 0, -1) if (m := ".".join(parts[:k])) in modules)

    for prompt in prompt_set.docstrings_set(TRAINING_DOCSTRINGS, TRAINING_SEED):
        text = prompt.messages[-1][1]
        quoted = text.split("\n\n", 1)[1] if "\n\n" in text else None  # the docstring's own `names`
        named = None if quoted else re.search(r"`([\w.]+)`", text)
        if quoted in names_by_doc:
            drawn.update(module_of(n) for n in names_by_doc[quoted])
        elif named:
            drawn.add(module_of(named.group(1)))
        else:
            raise RuntimeError(f"cannot tell which docstring this training prompt quotes: {text[:80]!r}")

    if prompt_set.topics_set(TRAINING_SEED):
        drawn.add("pydoc_data.topics")
    return sorted(drawn)


# --- command line ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help=f"where to write (default: {GROUNDED_PATH})")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if the file is out of date")
    p.add_argument(
        "--derive-exclusions",
        action="store_true",
        help="print the modules the training data draws on (EXCLUDED_MODULES must cover them)",
    )
    args = p.parse_args(argv)
    version = sys.version_info[:2]
    if args.derive_exclusions:
        drawn = training_modules()
        print("\n".join(textwrap.wrap(" ".join(drawn), 100)))
        missing = sorted(set(drawn) - EXCLUDED_MODULES)
        if missing:
            print(f"not in EXCLUDED_MODULES: {' '.join(missing)}", file=sys.stderr)
        return 1 if missing else 0
    out = args.out or GROUNDED_PATH
    if version != GROUNDED_PYTHON and (args.check or args.out is None):
        shipped = ".".join(map(str, GROUNDED_PYTHON))
        print(f"{GROUNDED_PATH.name} is written by Python {shipped}; this is {sys.version.split()[0]}")
        return 2
    content = render(build_records())
    if args.check:
        current = out.read_text(encoding="utf-8") if out.is_file() else None
        if current != content:
            print(f"{out} is out of date: run {Path(__file__).name}", file=sys.stderr)
            return 1
        print(f"{out} is up to date")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(content, encoding="utf-8")
    print(f"wrote {out} ({content.count(chr(10))} prompts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
