"""The target's side of a constraint: which tokens its distribution keeps at each verified node."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.core.grammar import GrammarState
from specserve.core.sampling import mask_disallowed
from specserve.core.tree import TokenTree
from specserve.errors import FailedPrecondition
from specserve.grammar.guide import Guide

_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)  # [8]


def allowed_tokens(bitmask: bytes, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """llguidance's bitmask (bit i of little-endian 32-bit words = token i) -> [vocab_size] bool. Ids past
    the tokenizer's vocabulary (a model's padded rows) are never allowed; FailedPrecondition when nothing
    is."""
    packed = torch.frombuffer(bytearray(bitmask), dtype=torch.uint8)  # [W * 4]; bytes of LE words
    bits = ((packed.unsqueeze(-1) >> _BIT_SHIFTS) & 1).flatten().bool()  # [W * 32]
    if bits.numel() < vocab_size:
        bits = torch.cat([bits, bits.new_zeros(vocab_size - bits.numel())])
    allowed = bits[:vocab_size]
    if not bool(allowed.any()):
        raise FailedPrecondition("the constraint allows no token here (its language has ended)")
    return allowed.to(device)


class PathMasks:
    """The allowed tokens at the nodes of one verification walk, which visits node 0 and then one child
    at a time (core/verify.py): the guide is pushed one token per step, so it ends at the accepted path.
    The guide must stand at the tree's root (the committed text) when the walk starts."""

    def __init__(self, guide: Guide, tree: TokenTree, vocab_size: int) -> None:
        self.guide = guide
        self.tree = tree
        self.vocab_size = vocab_size
        self.node = 0

    def allowed(self, node: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """[V] bool at `node`: node 0, the current node again, or a child of it."""
        if node != self.node:
            if self.tree.parent_ids[node] != self.node:
                raise ValueError(f"node {node} does not continue the walk at node {self.node}")
            self.guide.push([self.tree.token_ids[node]])
            self.node = node
        return allowed_tokens(self.guide.bitmask(), self.vocab_size, device)


class SpineMasks:
    """A drafter's side of a constraint: its logits at each depth of the spine it drafts, masked by the
    language after the spine so far (runtime/drafter.py, grow_spine_tree). `release` returns the grammar
    state to the committed text."""

    def __init__(self, grammar: GrammarState, token_ids: Sequence[int]) -> None:
        grammar.sync(token_ids)
        self.grammar = grammar
        self.pushed = 0

    def apply(self, logits: torch.Tensor) -> torch.Tensor | None:
        """logits [V] masked to what the language allows here; None when nothing is left (the language
        allows nothing more, or nothing the draft can score: a cut head scores part of the vocabulary)."""
        try:
            allowed = allowed_tokens(self.grammar.bitmask(), logits.shape[-1], logits.device)
        except FailedPrecondition:
            return None
        masked = mask_disallowed(logits, allowed)
        return masked if bool(torch.isfinite(masked).any()) else None

    def advance(self, token: int) -> None:
        self.grammar.push([token])
        self.pushed += 1

    def release(self) -> None:
        self.grammar.pop(self.pushed)
        self.pushed = 0
