"""A separate draft model's LM head cut to part of the vocabulary.

A 0.5B sibling's step reads its whole 151,936-row head: on a 2-core CPU its product alone takes 11 ms
of a 32 ms step (bf16, docs/benchmarks.md). Byte-level BPE vocabularies number their tokens in merge
order, which follows frequency in the tokenizer's corpus, so the first rows carry nearly all of what a
model writes (the first 32,768 of Qwen2.5's cover 95% of the 1.5B's MT-Bench answers); the special
tokens (end of turn) are kept wherever they sit. Scoring only those rows is a cheaper proposal, never a
different output: the target verifies every drafted token, and a draft that cannot propose a token
only loses that acceptance. The logits keep the full vocabulary's shape, -inf outside the kept rows,
so everything downstream (top-k, CaPE confidence, sampling, the verifier's q) is unchanged."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from specserve.errors import InvalidArgument
from specserve.runtime.int4 import Int4Linear, Int4Weight
from specserve.runtime.kernels import apply_linear_kernel


def kept_token_ids(vocab_size: int, rows: int, always: Iterable[int]) -> torch.Tensor:
    """The ids a cut head scores: 0..rows-1 and `always` (special tokens), sorted, within the vocabulary."""
    if rows < 1:
        raise InvalidArgument(f"a draft head needs at least one row, got {rows}")
    kept = set(range(min(rows, vocab_size))) | {i for i in always if 0 <= i < vocab_size}
    return torch.tensor(sorted(kept), dtype=torch.long)


class ReducedHead(nn.Module):
    """Scores the kept rows of a head; -inf everywhere else. [..., H] -> [..., V]."""

    def __init__(self, weight: torch.Tensor | Int4Linear, keep: torch.Tensor, kernel: str = "native") -> None:
        super().__init__()
        self.keep: torch.Tensor
        self.rows: nn.Module
        if isinstance(weight, Int4Linear):  # a head on its file's codes keeps them: the kept rows' codes
            source = weight.int4
            self.vocab_size = weight.out_features
            self.register_buffer("keep", keep.to(source.device), persistent=False)  # [K]
            kept = Int4Weight(
                source.source.rows(keep.numpy()), source.device, source.requested_dtype, source.kernel
            )
            self.rows = Int4Linear(kept, None)
            return
        vocab_size, hidden = weight.shape  # [V, H]
        self.vocab_size = vocab_size
        self.register_buffer("keep", keep.to(weight.device), persistent=False)  # [K]
        rows = nn.Linear(hidden, len(keep), bias=False, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            rows.weight.copy_(weight.detach()[self.keep])  # [K, H]
        rows.weight.requires_grad_(False)
        self.rows = rows
        apply_linear_kernel(self, kernel)  # the same packed kernel as the model's other layers

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        scores = self.rows(hidden)  # [..., K]
        logits = scores.new_full((*scores.shape[:-1], self.vocab_size), float("-inf"))  # [..., V]
        return logits.index_copy_(-1, self.keep, scores)


def cut_head(model: nn.Module, rows: int, always: Iterable[int], kernel: str = "native") -> None:
    """Replaces a causal LM's output head, in place, by one over its first `rows` ids plus `always`."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    if isinstance(head, Int4Linear):
        model.lm_head = ReducedHead(head, kept_token_ids(head.out_features, rows, always), kernel)
        return
    weight = head.weight  # [V, H]; a packed head unpacks on demand
    model.lm_head = ReducedHead(weight, kept_token_ids(weight.shape[0], rows, always), kernel)
