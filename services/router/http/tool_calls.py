"""An answer's text, as it streams, split into content and tool calls in OpenAI's shape.

The text is in tools.py's format (`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`, one
block per call), which the grammar guarantees under `required` and a named function, and under `auto`
once the text opens with `<tool_call>`. Each call is reported as OpenAI streams one: a first delta with
its `index`, `id` and `function.name` as soon as the name is known, then `function.arguments` in pieces,
exactly the characters the model wrote. A whole response is the same deltas joined, so a streamed and a
plain answer agree.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass, field

from services.router.http.tools import CLOSE, OPEN

# A call's body up to its arguments' value; the grammar writes "name" first.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:')
_TAIL = re.compile(r"\s*\}\s*" + re.escape(CLOSE))
_SCALAR_END = re.compile(r"[\s,}\]]")


def call_id(session_id: str, index: int) -> str:
    """A call's id: the same for the same session and call, so a resumed stream and a repeated parse
    name a call as the first did (a fresh one without a session)."""
    if not session_id:
        return f"call_{uuid.uuid4().hex[:24]}"
    return f"call_{hashlib.sha256(f'{session_id}:{index}'.encode()).hexdigest()[:24]}"


@dataclass
class CallDelta:
    """One piece of a call, as one entry of a chunk's `delta.tool_calls`."""

    index: int
    arguments: str = ""
    id: str | None = None  # with the name, on the call's first delta only
    name: str | None = None

    def to_json(self) -> dict:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""
    complete: bool = False  # its block closed

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class _Arguments:
    """Where an arguments value ends: JSON's nesting, outside strings."""

    started: bool = False
    scalar: bool = False  # a bare number or literal, which ends at a delimiter
    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def end(self, text: str, start: int) -> tuple[int, int | None]:
        """Scans text[start:]: (where the value's text begins, or start if it did not yet; the index just
        past its end, or None if it goes on)."""
        begin = start
        for i in range(start, len(text)):
            c = text[i]
            if not self.started:
                if c.isspace():
                    begin = i + 1
                    continue
                self.started, self.scalar = True, c not in '{["'
            if self.scalar:
                match = _SCALAR_END.search(text, i)
                return begin, None if match is None else match.start()
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return begin, i + 1
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return begin, i + 1
        return begin, None


@dataclass
class ToolCallParser:
    """Text in, call deltas out, as the text grows."""

    session_id: str = ""  # names the calls (call_id)
    text: str = ""
    calls: list[ParsedCall] = field(default_factory=list)
    _pos: int = 0
    _stage: str = "between"  # between calls, "head" (before the arguments), "arguments", "tail", "junk"
    _arguments: _Arguments = field(default_factory=_Arguments)

    def feed(self, text: str) -> list[CallDelta]:
        self.text += text
        deltas: list[CallDelta] = []
        while self._step(deltas):
            pass
        return deltas

    @property
    def complete(self) -> bool:
        """Every call closed and nothing else written (whitespace aside)."""
        return self._stage == "between" and not self.text[self._pos :].strip() and bool(self.calls)

    def _step(self, deltas: list[CallDelta]) -> bool:
        """One move through the text; False when it needs more text."""
        text, pos = self.text, self._pos
        if self._stage == "between":
            rest = text[pos:].lstrip()
            if rest.startswith(OPEN):
                self._pos, self._stage = len(text) - len(rest) + len(OPEN), "head"
                return True
            if not OPEN.startswith(rest):
                self._stage = "junk"  # not the format: the grammar's job, never expected here
            return False
        if self._stage == "head":
            head = _HEAD.match(text, pos)
            if head is None:
                return False
            call = ParsedCall(call_id(self.session_id, len(self.calls)), json.loads(f'"{head.group(1)}"'))
            self.calls.append(call)
            deltas.append(CallDelta(len(self.calls) - 1, "", call.id, call.name))
            self._pos, self._stage, self._arguments = head.end(), "arguments", _Arguments()
            return True
        if self._stage == "arguments":
            begin, end = self._arguments.end(text, pos)
            piece = text[begin : len(text) if end is None else end]
            if piece:
                self.calls[-1].arguments += piece
                deltas.append(CallDelta(len(self.calls) - 1, piece))
            if end is None:
                self._pos = len(text) if self._arguments.started else begin
                return False
            self._pos, self._stage = end, "tail"
            return True
        if self._stage == "tail":
            tail = _TAIL.match(text, pos)
            if tail is None:
                return False
            self.calls[-1].complete = True
            self._pos, self._stage = tail.end(), "between"
            return True
        return False


class ToolStream:
    """An answer under `tool_choice` `mode`: calls throughout ("required", "named"), or ("auto") calls if
    the text opens with `<tool_call>` past whitespace, else content; undecided text is held back."""

    def __init__(self, mode: str, session_id: str = "") -> None:
        self.calls_mode: bool | None = None if mode == "auto" else True
        self.parser = ToolCallParser(session_id)
        self._held = ""

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """(content, call deltas) of the next piece of text."""
        if self.calls_mode is None:
            self._held += text
            rest = self._held.lstrip()
            if OPEN.startswith(rest) and not rest.startswith(OPEN):  # either, so far
                return "", []
            self.calls_mode = rest.startswith(OPEN)
            text, self._held = self._held, ""
        if self.calls_mode:
            return "", self.parser.feed(text)
        return text, []

    def finish(self) -> str:
        """Content still held back once the answer ended (it never became a call)."""
        if self.calls_mode is None:
            self.calls_mode = False
        held, self._held = self._held, ""
        return held

    @property
    def calls(self) -> list[ParsedCall]:
        return self.parser.calls if self.calls_mode else []
