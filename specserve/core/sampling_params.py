"""How a token is chosen: a session's sampling parameters (core/request.py validates them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next-token distribution is turned into a choice.

    temperature == 0 means greedy. top_k == 0 disables top-k; top_p == 1 disables top-p. The same
    processing is applied to target and draft logits, so verification stays lossless. Fixed for a
    whole session: drafters and verifiers are given it once, when the session starts.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams()
