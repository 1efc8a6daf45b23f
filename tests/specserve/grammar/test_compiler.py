from __future__ import annotations

import pytest

from specserve.core.constraint import Constraint, ConstraintKind, InvalidConstraint
from specserve.grammar import GrammarCompiler
from specserve.grammar.schema import json_schema_constraint

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_json_is_written_as_json_dumps_writes_it(compiler: GrammarCompiler):
    # One spelling per value: the keys and separators a schema fixes are forced, in its property order.
    guide = compiler.guide(json_schema_constraint(SCHEMA), 0, 64)
    # The matcher's own forced tokens stop before ` "`, which a longer token (` "A`) could begin; the
    # forced text goes on to the string's opening quote, and the guide drafts all of it.
    assert compiler.tokenizer.decode_str(guide.matcher.compute_ff_tokens()) == '{"name":'
    assert compiler.tokenizer.decode_str(guide.forced()) == '{"name": "'
    text = '{"name": "Ann", "age": 7}'
    tokens = compiler.tokenizer.tokenize_str(text)
    assert guide.allowed_prefix(tokens) == len(tokens)
    compact = compiler.tokenizer.tokenize_str('{"name":"Ann","age":7}')
    assert guide.allowed_prefix(compact) < len(compact)


def test_a_schema_that_says_otherwise_keeps_its_layout(compiler: GrammarCompiler):
    flexible = {"x-guidance": {"whitespace_flexible": True}} | SCHEMA
    guide = compiler.guide(json_schema_constraint(flexible), 0, 64)
    tokens = compiler.tokenizer.tokenize_str('{\n  "name": "Ann",\n  "age": 7\n}')
    assert guide.allowed_prefix(tokens) == len(tokens)


@pytest.mark.parametrize(
    ("kind", "source", "message"),
    [
        (ConstraintKind.JSON_SCHEMA, '{"type": "nonsense"}', "json_schema cannot be compiled"),
        (ConstraintKind.JSON_SCHEMA, "{not json", "not valid JSON"),
        (ConstraintKind.JSON_SCHEMA, "[1, 2]", "must be an object or a boolean"),
        (ConstraintKind.REGEX, "(unclosed", "regex cannot be compiled"),
        (ConstraintKind.GRAMMAR, "start: undefined_rule", "grammar cannot be compiled"),
    ],
)
def test_what_does_not_compile_is_an_invalid_argument(
    compiler: GrammarCompiler, kind: ConstraintKind, source: str, message: str
):
    with pytest.raises(InvalidConstraint, match=message):
        compiler.compile(Constraint(kind, source))


def test_a_constraint_compiles_once_and_each_session_gets_its_own_matcher(compiler: GrammarCompiler):
    constraint = Constraint(ConstraintKind.REGEX, r"(yes|no)\.")
    first = compiler.compile(constraint)
    second = compiler.compile(constraint)
    assert first is not second and constraint in compiler._compiled
    assert first.consume_tokens(compiler.tokenizer.tokenize_str("yes"))
    # the second session is still at the start of the language
    assert second.validate_tokens(compiler.tokenizer.tokenize_str("no.")) == len(
        compiler.tokenizer.tokenize_str("no.")
    )


def test_json_object_and_grammar_kinds(compiler: GrammarCompiler):
    obj = compiler.guide(Constraint(ConstraintKind.JSON_OBJECT), 0, 64)
    tokens = compiler.tokenizer.tokenize_str('{"anything": [1, 2]}')
    assert obj.allowed_prefix(tokens) == len(tokens)
    assert obj.allowed_prefix(compiler.tokenizer.tokenize_str("[1]")) == 0
    lark = compiler.guide(Constraint(ConstraintKind.GRAMMAR, 'start: "A" | "B" "C"'), 0, 64)
    assert lark.allowed_prefix(compiler.tokenizer.tokenize_str("BC")) == len(
        compiler.tokenizer.tokenize_str("BC")
    )
