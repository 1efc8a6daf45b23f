from __future__ import annotations

import pytest
import torch

from specserve.core.constraint import Constraint, ConstraintKind
from specserve.core.sampling import mask_disallowed
from specserve.core.tree import TokenTree
from specserve.errors import FailedPrecondition
from specserve.grammar import GrammarCompiler
from specserve.grammar.masks import PathMasks, allowed_tokens, bitmask_allows


def test_allowed_tokens_decodes_the_bitmask():
    # words little-endian: token 0 and token 33 allowed, of a 40-token vocabulary padded to 48 rows
    words = torch.tensor([1, 2], dtype=torch.int32).numpy().tobytes()
    allowed = allowed_tokens(words, 48)
    assert allowed.shape == (48,) and allowed.nonzero().flatten().tolist() == [0, 33]
    with pytest.raises(FailedPrecondition, match="allows no token"):
        allowed_tokens(bytes(8), 40)


def test_bitmask_allows_reads_the_same_bits():
    g = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31 - 1, (5,), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask = words.numpy().tobytes()  # 160 tokens
    allowed = allowed_tokens(bitmask, 170)  # 10 padded rows past the bitmask
    assert [bitmask_allows(bitmask, t) for t in range(170)] == allowed.tolist()


def test_masks_match_the_language(compiler: GrammarCompiler):
    guide = compiler.guide(Constraint(ConstraintKind.REGEX, "(cat|dog)s"), 0, 64)
    allowed = allowed_tokens(guide.bitmask(), compiler.vocab_size)
    for word in ("cat", "dog"):
        assert allowed[compiler.tokenizer.tokenize_str(word)[0]]
    assert not allowed[compiler.tokenizer.tokenize_str("bird")[0]]
    logits = torch.zeros(compiler.vocab_size)
    assert torch.isinf(mask_disallowed(logits, allowed)).sum() == (~allowed).sum()


def test_path_masks_push_one_token_per_step_of_the_walk(compiler: GrammarCompiler):
    guide = compiler.guide(Constraint(ConstraintKind.REGEX, "(cat|dog)s"), 0, 64)
    cat, dog = compiler.tokenizer.tokenize_str("cat")[0], compiler.tokenizer.tokenize_str("dog")[0]
    s = compiler.tokenizer.tokenize_str("s")[0]
    tree = TokenTree((99, cat, dog, s), (-1, 0, 0, 1))
    masks = PathMasks(guide, tree, compiler.vocab_size)
    assert masks.allowed(0)[cat]
    assert masks.allowed(1)[s] and guide.num_consumed == 1  # walked to "cat"
    assert masks.allows(1, s) and not masks.allows(1, cat) and not masks.allows(1, compiler.vocab_size)
    with pytest.raises(ValueError, match="does not continue"):
        masks.allowed(2)  # "dog" is a sibling, not a child, of the walk's node
