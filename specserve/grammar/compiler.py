"""Compiling constraints against one tokenizer, once per distinct constraint.

llguidance builds a matcher from a grammar lazily (its lexer grows as masks are asked for), so the
first matcher of a constraint is kept and each session starts from a deep copy of it: a schema every
request repeats is compiled once per process. Why llguidance (and not xgrammar): docs/structured-output.md.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable

import llguidance

from specserve.core.constraint import Constraint, ConstraintKind, InvalidConstraint
from specserve.grammar.guide import Guide
from specserve.grammar.schema import parse_json_schema

# JSON as json.dumps writes it (", " between items, ": " after keys, no other whitespace) unless the
# schema says otherwise (its "x-guidance" key): one spelling per value, so the grammar forces the keys,
# separators and brackets a schema fixes, and those become free draft tokens.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHED_CONSTRAINTS = 64  # compiled constraints kept per compiler (least recently used dropped)


def grammar_source(constraint: Constraint) -> str:
    """The llguidance grammar (its JSON or Lark text) of a constraint; InvalidConstraint if it cannot be
    translated."""
    if constraint.kind is ConstraintKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(constraint.source)
    if constraint.kind is ConstraintKind.GRAMMAR:
        return llguidance.LLMatcher.grammar_from_lark(constraint.source)
    json_object = constraint.kind is ConstraintKind.JSON_OBJECT
    schema = {"type": "object"} if json_object else parse_json_schema(constraint.source)
    if isinstance(schema, dict):
        schema = {"x-guidance": JSON_LAYOUT} | schema
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    except (ValueError, TypeError) as e:
        raise InvalidConstraint(f"the JSON schema cannot be compiled: {e}") from None


class GrammarCompiler:
    """Matchers for one tokenizer (`tokenizer_json`: the tokenizers library's JSON, as the router gets
    it from ModelInfo). `eos_token_ids`: what ends the text once the language is complete."""

    def __init__(
        self, tokenizer_json: str, eos_token_ids: Iterable[int], vocab_size: int | None = None
    ) -> None:
        eos = sorted(set(eos_token_ids))
        if not eos:
            raise ValueError("a grammar needs an end-of-sequence token")
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        # verbose_errors off: an error message must not echo one request's grammar state to logs.
        self.limits = llguidance.LLParserLimits(verbose_errors=False)
        self._compiled: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.vocab_size)

    def compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher at the start of the constraint's language; InvalidConstraint if it does not
        compile (the message says why)."""
        with self._lock:
            template = self._compiled.get(constraint)
            if template is not None:
                self._compiled.move_to_end(constraint)
                return template.deep_copy()
        # Built outside the lock: llguidance releases the GIL while it builds, so other sessions go on.
        template = llguidance.LLMatcher(
            self.tokenizer, grammar_source(constraint), log_level=0, limits=self.limits
        )
        if template.is_error():
            raise InvalidConstraint(f"the {constraint.kind.value} cannot be compiled: {template.get_error()}")
        with self._lock:
            self._compiled[constraint] = template
            while len(self._compiled) > CACHED_CONSTRAINTS:
                self._compiled.popitem(last=False)
            return template.deep_copy()

    def guide(self, constraint: Constraint, num_prompt_tokens: int, max_tree_nodes: int) -> Guide:
        """A session's guide: the language starts after the prompt's `num_prompt_tokens` tokens; drafts
        it shapes keep at most `max_tree_nodes` nodes."""
        return Guide(self.compile(constraint), num_prompt_tokens, max_tree_nodes, self.tokenizer)
