"""The two roles of the speculative loop. In-process and gRPC implementations both satisfy these."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specserve.core.sampling_params import SamplingParams
from specserve.core.tree import TokenTree
from specserve.core.verify import CandidateKind, VerifyOutcome


@dataclass(frozen=True)
class DraftTree:
    """A proposal: the tree plus what the verifier needs to accept losslessly.

    draft_probs is only needed for sampled candidates (q of each internal node); fixed candidates
    (greedy drafts, top-k expansions) verify without it, so nothing vocabulary-sized has to travel.
    """

    tree: TokenTree
    kind: CandidateKind = CandidateKind.FIXED
    draft_probs: Mapping[int, torch.Tensor] = field(default_factory=dict)  # node -> q [V]

    @classmethod
    def root_only(cls, root_token: int) -> DraftTree:
        return cls(TokenTree((root_token,), (-1,)))

    @property
    def num_draft_tokens(self) -> int:
        return self.tree.num_nodes - 1


class Drafter(Protocol):
    def propose(self, token_ids: Sequence[int], params: SamplingParams, seed: int) -> DraftTree:
        """token_ids: the whole committed sequence (prompt + generated); its last token is the root."""
        ...

    def release(self) -> None: ...


class Verifier(Protocol):
    def prefill(self, prompt_ids: Sequence[int], params: SamplingParams, seed: int) -> int:
        """Computes the prompt's KV and returns the first generated token."""
        ...

    def verify(self, draft: DraftTree, params: SamplingParams, seed: int) -> VerifyOutcome:
        """One target forward over the tree, acceptance, and commit of the accepted path's KV."""
        ...

    def release(self) -> None: ...
