"""A tiny stand-in satisfying the Engine contract, for testing the harness's bookkeeping.

The real engine is tested elsewhere; this one produces real token lists (a deterministic function
of the prompt) and counters from a fixed cost model, so aggregates can be checked exactly.
`vanilla` deliberately changes its last token on prompts containing "Diverge", so
identical_to_target is exercised below N.
"""

from __future__ import annotations

import math

from specserve.core.request import GenerationRequest
from specserve.errors import InvalidArgument
from specserve.results import FinishReason, GenerationResult, GenerationStats, OnTokens

# method -> (tokens emitted per target forward, drafts offered per forward, seconds per forward)
COST_MODEL = {"target": (1, 0, 0.010), "hf": (3, 2, 0.012), "vanilla": (2, 4, 0.015)}


def fake_token_ids(prompt: str, n: int) -> list[int]:
    return [(ord(c) * 31 + i) % 50_000 for i, c in enumerate(prompt[:n])]


class FakeEngine:
    def __init__(self, settings: object = None, methods: tuple[str, ...] = tuple(COST_MODEL)) -> None:
        self.settings = settings
        self._methods = list(methods)
        self.calls: list[tuple[str, str, int]] = []  # (prompt, method, max_new_tokens), in order

    @property
    def methods(self) -> list[str]:
        return list(self._methods)

    def generate(
        self, prompt: str, request: GenerationRequest, on_tokens: OnTokens | None = None
    ) -> GenerationResult:
        method, max_new_tokens = request.method, request.stopping.max_new_tokens
        if method not in self._methods:
            raise InvalidArgument(f"unknown method {method!r}")
        if not prompt:
            raise InvalidArgument("empty prompt")
        self.calls.append((prompt, method, max_new_tokens))
        n = min(max_new_tokens, len(prompt))
        ids = fake_token_ids(prompt, n)
        if method == "vanilla" and "Diverge" in prompt:
            ids[-1] += 1
        if on_tokens is not None:
            on_tokens(ids)
        per_forward, drafts, seconds = COST_MODEL[method]
        forwards = math.ceil(n / per_forward)
        stats = GenerationStats(
            num_target_forwards=forwards,
            num_draft_tokens=drafts * forwards,
            num_accepted_tokens=n - forwards if drafts else 0,
            num_generated_tokens=n,
            elapsed_s=seconds * forwards,
        )
        finish = FinishReason.LENGTH if n == max_new_tokens else FinishReason.EOS
        return GenerationResult(token_ids=ids, text=prompt[:n], finish_reason=finish, stats=stats)
