from __future__ import annotations

import pytest

from specserve.core.constraint import Constraint, ConstraintKind
from specserve.errors import FailedPrecondition
from specserve.grammar import GrammarCompiler
from specserve.grammar.guide import Guide
from specserve.grammar.masks import allowed_tokens


def test_sync_consumes_only_the_generated_tokens(compiler: GrammarCompiler):
    prompt = [1, 2, 3]  # not in the language: a guide never sees the prompt
    guide = compiler.guide(Constraint(ConstraintKind.REGEX, "[0-9]+"), len(prompt), 64)
    digits = compiler.tokenizer.tokenize_str("42")
    guide.sync(prompt)
    assert guide.num_consumed == 0
    guide.sync([*prompt, *digits])
    guide.sync([*prompt, *digits])  # nothing new: a no-op
    assert guide.num_consumed == len(digits)


def test_push_pop_walks_and_returns(compiler: GrammarCompiler):
    guide = compiler.guide(Constraint(ConstraintKind.REGEX, "ab|ac"), 0, 64)
    a, b = compiler.tokenizer.tokenize_str("a"), compiler.tokenizer.tokenize_str("b")
    guide.push(a)
    assert guide.allowed_prefix(b) == 1
    guide.pop(len(a))
    assert guide.num_consumed == 0 and guide.allowed_prefix(b) == 0


def test_a_forbidden_token_is_refused(compiler: GrammarCompiler):
    guide = compiler.guide(Constraint(ConstraintKind.REGEX, "[0-9]+"), 0, 64)
    with pytest.raises(FailedPrecondition, match="does not allow"):
        guide.push(compiler.tokenizer.tokenize_str("x"))


EOS = 2  # SmolLM2's <|im_end|>, the compiler fixture's end of sequence


def test_a_complete_language_takes_its_end_of_sequence(compiler: GrammarCompiler):
    guide = compiler.guide(Constraint(ConstraintKind.REGEX, "ok"), 0, 64)
    guide.push(compiler.tokenizer.tokenize_str("ok"))
    assert guide.done  # nothing can follow but the end of sequence
    assert allowed_tokens(guide.bitmask(), compiler.vocab_size).nonzero().flatten().tolist() == [EOS]
    guide.push([EOS])  # taken, though llguidance refuses it in a batch once the language is complete
    assert guide.num_consumed == len(compiler.tokenizer.tokenize_str("ok")) + 1


def test_forced_is_the_only_continuation(compiler: GrammarCompiler):
    guide = compiler.guide(Constraint(ConstraintKind.REGEX, "hello world|hello there"), 0, 64)
    assert compiler.tokenizer.decode_str(guide.forced()) == "hello "  # the space too: both go on with it
    guide.push(compiler.tokenizer.tokenize_str("hello"))
    assert compiler.tokenizer.decode_str(guide.forced()) == " "
    guide.push(compiler.tokenizer.tokenize_str(" w"))
    assert compiler.tokenizer.decode_str(guide.forced()) == "orld"


def test_forced_without_a_tokenizer_is_the_matchers_tokens(compiler: GrammarCompiler):
    constraint = Constraint(ConstraintKind.REGEX, "hello world|hello there")
    guide = Guide(compiler.compile(constraint), 0, 64)
    assert guide.forced() == list(guide.matcher.compute_ff_tokens())


def test_popping_the_end_of_sequence_returns_to_the_open_text(compiler: GrammarCompiler):
    # A drafter pushes its spine, the end of sequence included, and pops it all after the round.
    constraint = Constraint(ConstraintKind.JSON_OBJECT)
    guide, fresh = compiler.guide(constraint, 0, 64), compiler.guide(constraint, 0, 64)
    opening = compiler.tokenizer.tokenize_str('{"a": 1')
    guide.push(opening)
    fresh.push(opening)
    guide.push([*compiler.tokenizer.tokenize_str("}"), EOS])
    guide.pop(2)
    assert guide.bitmask() == fresh.bitmask() and guide.num_consumed == fresh.num_consumed
    more = compiler.tokenizer.tokenize_str(', "b": 2}')
    assert guide.allowed_prefix(more) == len(more)
