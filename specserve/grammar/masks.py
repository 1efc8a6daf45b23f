"""The target's side of a constraint: which tokens its distribution keeps at each verified node."""

from __future__ import annotations

import torch

from specserve.core.tree import TokenTree
from specserve.errors import FailedPrecondition
from specserve.grammar.guide import Guide

_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)  # [8]


def allowed_tokens(bitmask: bytes, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """llguidance's bitmask (bit i of little-endian 32-bit words = token i) -> [vocab_size] bool. Ids past
    the tokenizer's vocabulary (a model's padded rows) are never allowed."""
    packed = torch.frombuffer(bytearray(bitmask), dtype=torch.uint8)  # [W * 4]; bytes of LE words
    bits = ((packed.unsqueeze(-1) >> _BIT_SHIFTS) & 1).flatten().bool()  # [W * 32]
    if bits.numel() < vocab_size:
        bits = torch.cat([bits, bits.new_zeros(vocab_size - bits.numel())])
    allowed = bits[:vocab_size]
    if not bool(allowed.any()):
        raise FailedPrecondition("the constraint allows no token here (its language has ended)")
    return allowed.to(device)


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [V] with every token outside `allowed` [V] at -inf: the distribution the constrained
    target samples from (and argmaxes over)."""
    return logits.masked_fill(~allowed, float("-inf"))


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
