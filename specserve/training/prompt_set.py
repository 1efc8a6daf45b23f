"""The prompts the target answers for self-distillation: broad, deduplicated, never MT-Bench.

Sources (each prompt is a list of chat messages ending with a user turn, tagged with its source):
- `written`: the templates x subjects of `prompts.py`;
- `dummy`: the user turns of FastChat's 500 conversations; a later turn comes with the conversation's
  earlier turns (multi-turn follow-ups at no generation cost);
- `topics`: questions about the Python reference topics of `pydoc_data.topics` (always installed);
- `docstrings`: questions built from the standard library's docstrings (read with `ast`, never imported);
- `self-instruct`: questions the target itself wrote when asked for requests in the spirit of each
  MT-Bench category (stage 1 of generation, see `generation.py`), parsed from its answers.

MT-Bench is evaluation data: any prompt that contains an MT-Bench question (normalised) is dropped, and
a test checks the final set.
"""

from __future__ import annotations

import ast
import random
import re
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from specserve.training.prompts import _SUBJECTS, written_prompts

Messages = tuple[tuple[str, str], ...]  # ((role, content), ...), ends with a user turn


@dataclass(frozen=True)
class Prompt:
    source: str
    messages: Messages

    def as_chat(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]


def user(text: str) -> Messages:
    return (("user", text),)


# --- written and FastChat ------------------------------------------------------------------------


def written_set() -> list[Prompt]:
    return [Prompt("written", user(p)) for p in written_prompts(100_000, seed=0)]


def dummy_set(max_chars: int = 4000) -> list[Prompt]:
    """Every user turn of the FastChat conversations, with the turns before it."""
    from specserve.training.corpus import dummy_conversations

    out = []
    for conversation in dummy_conversations():
        for i, turn in enumerate(conversation):
            if turn["role"] != "user":
                continue
            history = tuple((t["role"], t["content"]) for t in conversation[: i + 1])
            if sum(len(c) for _, c in history) <= max_chars:
                out.append(Prompt("dummy", history))
    return out


# --- the Python reference and docstrings -----------------------------------------------------------

_TOPIC_TEMPLATES = [
    "Explain the Python topic '{t}' to a beginner, with a short example.",
    "What are common mistakes people make with '{t}' in Python, and how can they be avoided?",
    "Summarize in a few bullet points what the Python language reference says about '{t}'.",
]
_PASSAGE_TEMPLATES = [
    "Explain this passage from the Python documentation in plain words:\n\n{p}",
    "Summarize the following text in two sentences:\n\n{p}",
    "Write one quiz question, with its answer, about this text:\n\n{p}",
]
_DOC_TEMPLATES = [
    "What does `{name}` do in Python? Give a short example of using it.",
    "Explain this Python docstring in simple terms:\n\n{doc}",
    "When would I use `{name}` in a Python program?",
]


def _paragraphs(text: str, min_chars: int = 200, max_chars: int = 900) -> list[str]:
    paras = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", text)]
    return [p for p in paras if min_chars <= len(p) <= max_chars and not p.startswith(("*", "+", "="))]


def topics_set(seed: int = 0) -> list[Prompt]:
    import pydoc_data.topics

    rng = random.Random(seed)
    out = []
    for name, text in sorted(pydoc_data.topics.topics.items()):
        readable = name.replace("-", " ")
        out += [Prompt("topics", user(t.format(t=readable))) for t in _TOPIC_TEMPLATES]
        for para in _paragraphs(text)[:6]:
            out.append(Prompt("topics", user(rng.choice(_PASSAGE_TEMPLATES).format(p=para))))
    return out


def _stdlib_docstrings() -> Iterable[tuple[str, str]]:
    """(dotted public name, docstring) of modules, classes and functions of the non-test stdlib."""
    from specserve.training.corpus import stdlib_files

    root = Path(sysconfig.get_paths()["stdlib"])
    for path in stdlib_files():
        parts = path.relative_to(root).with_suffix("").parts
        if any(p.startswith("_") and p != "__init__" for p in parts):
            continue
        module = ".".join(p for p in parts if p != "__init__")
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc:
                    yield f"{module}.{node.name}", doc
                if isinstance(node, ast.ClassDef):
                    for sub in node.body:
                        if isinstance(sub, ast.FunctionDef) and not sub.name.startswith("_"):
                            doc = ast.get_docstring(sub)
                            if doc:
                                yield f"{module}.{node.name}.{sub.name}", doc


def docstrings_set(count: int = 3000, seed: int = 0) -> list[Prompt]:
    rng = random.Random(seed)
    found = [(n, d) for n, d in _stdlib_docstrings() if 60 <= len(d) <= 1500]
    rng.shuffle(found)
    out = []
    for name, doc in found[:count]:
        template = rng.choice(_DOC_TEMPLATES)
        out.append(Prompt("docstrings", user(template.format(name=name, doc=doc.strip()))))
    return out


# --- self-instruct: the target writes questions ------------------------------------------------------

# Categories in the spirit of MT-Bench's eight (never its questions): what kind of request to write.
SELF_INSTRUCT_KINDS = {
    "writing": "creative or practical writing tasks (stories, emails, blog posts, poems)",
    "roleplay": "role-play requests (pretend to be a character, a professional or a famous person)",
    "reasoning": "logic puzzles and reasoning questions",
    "math": "math word problems and calculation questions",
    "coding": "programming questions and small coding tasks",
    "extraction": "tasks that extract or reformat information from a short text given in the request",
    "stem": "science, technology and engineering questions",
    "humanities": "history, economics, philosophy, art and social science questions",
}


def self_instruct_requests(subjects_per_kind: int = 24, seed: int = 0) -> list[Prompt]:
    """Stage-1 prompts: ask the target to write numbered user requests of each kind about a subject."""
    rng = random.Random(seed)
    out = []
    for description in SELF_INSTRUCT_KINDS.values():
        for subject in rng.sample(_SUBJECTS, min(subjects_per_kind, len(_SUBJECTS))):
            text = (
                f"Write 8 different requests that a user might send to an AI assistant: {description}, "
                f"related to {subject}. Write each request as a complete message on its own numbered line."
            )
            out.append(Prompt("self-instruct-request", user(text)))
    return out


_NUMBERED = re.compile(r"^\s*(?:\d+[.)]|[-*])\s+(.*\S)\s*$")


def parse_requests(answer: str, min_chars: int = 25, max_chars: int = 600) -> list[str]:
    """The numbered or bulleted lines of a self-instruct answer, cleaned."""
    out = []
    for line in answer.splitlines():
        match = _NUMBERED.match(line)
        if not match:
            continue
        text = match.group(1).strip().strip('"').replace("**", "").strip()
        if min_chars <= len(text) <= max_chars:
            out.append(text)
    return out


# --- MT-Bench exclusion and deduplication --------------------------------------------------------


def normalise(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def mtbench_turns() -> list[str]:
    """Every turn of every MT-Bench question, normalised (the evaluation set)."""
    import json

    from specserve.bench.workloads import default_prompts_path

    turns = []
    for line in default_prompts_path().read_text().splitlines():
        if line.strip():
            turns += [normalise(t) for t in json.loads(line)["turns"]]
    return turns


def contains_mtbench(prompt: Prompt, turns: Sequence[str], probe_chars: int = 60) -> bool:
    """True if any message contains the start of an MT-Bench turn (or is contained in one)."""
    for _, content in prompt.messages:
        text = normalise(content)
        for turn in turns:
            probe = turn[:probe_chars]
            if probe in text or (len(text) >= 40 and text in turn):
                return True
    return False


def deduplicate(prompts: Iterable[Prompt]) -> list[Prompt]:
    seen: set[tuple[str, ...]] = set()
    out = []
    for p in prompts:
        key = tuple(normalise(c) for _, c in p.messages)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def finalise(prompts: Iterable[Prompt], seed: int) -> list[Prompt]:
    """Deduplicated, MT-Bench-free, in a seeded random order (every prefix mixes every source)."""
    turns = mtbench_turns()
    kept = [p for p in deduplicate(prompts) if not contains_mtbench(p, turns)]
    random.Random(seed).shuffle(kept)
    return kept


def base_prompts(seed: int = 0, docstrings: int = 3000) -> list[Prompt]:
    """The prompts that need no generation first (stage 2 adds the self-instruct ones)."""
    return [*written_set(), *dummy_set(), *topics_set(seed), *docstrings_set(docstrings, seed)]
