"""The target's side of a constraint: which tokens its distribution keeps at each verified node."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specserve.core.grammar import GrammarState
from specserve.core.sampling import mask_disallowed
from specserve.core.tree import TokenTree
from specserve.errors import FailedPrecondition
from specserve.grammar.guide import Guide


def allowed_tokens(bitmask: bytes, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """llguidance's bitmask (bit i of little-endian 32-bit words = token i) -> [vocab_size] bool. Ids past
    the tokenizer's vocabulary (a model's padded rows) are never allowed; FailedPrecondition when nothing
    is."""
    # The bytes of little-endian words hold token i at byte i // 8, bit i % 8: one unpacking call.
    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")  # [W * 32]
    allowed = np.zeros(vocab_size, dtype=bool)  # [vocab_size]
    count = min(vocab_size, bits.size)
    allowed[:count] = bits[:count]
    if not allowed.any():
        raise FailedPrecondition("the constraint allows no token here (its language has ended)")
    return torch.from_numpy(allowed).to(device)


def bitmask_allows(bitmask: bytes, token: int) -> bool:
    """Whether llguidance's bitmask allows `token` (ids past it never are)."""
    byte = token >> 3
    return token >= 0 and byte < len(bitmask) and bool(bitmask[byte] >> (token & 7) & 1)


class PathMasks:
    """The allowed tokens at the nodes of one verification walk (core/accept.py's NodeMasks), which
    visits node 0 and then one child at a time (core/verify.py): the guide is pushed one token per step,
    so it ends at the accepted path. The guide must stand at the tree's root (the committed text) when the
    walk starts."""

    def __init__(
        self, guide: Guide, tree: TokenTree, vocab_size: int, device: torch.device | str = "cpu"
    ) -> None:
        self.guide = guide
        self.tree = tree
        self.vocab_size = vocab_size
        self.device = device
        self.node = 0
        self._bitmask: bytes | None = None  # the walk's node's

    def _at(self, node: int) -> bytes:
        """The bitmask at `node`: node 0, the current node again, or a child of it."""
        if node != self.node:
            if self.tree.parent_ids[node] != self.node:
                raise ValueError(f"node {node} does not continue the walk at node {self.node}")
            self.guide.push([self.tree.token_ids[node]])
            self.node, self._bitmask = node, None
        if self._bitmask is None:
            self._bitmask = self.guide.bitmask()
        return self._bitmask

    def allowed(self, node: int) -> torch.Tensor:
        """[V] bool at `node`."""
        return allowed_tokens(self._at(node), self.vocab_size, self.device)

    def allows(self, node: int, token: int) -> bool:
        return token < self.vocab_size and bitmask_allows(self._at(node), token)


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
