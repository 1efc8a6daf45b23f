"""What a generation returns: tokens, text and the counters every tool reports."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import StrEnum

OnTokens = Callable[[list[int]], None]  # called with each run of tokens a generation emits, in order


class FinishReason(StrEnum):
    EOS = "eos"
    LENGTH = "length"
    STOP = "stop"


@dataclass
class GenerationStats:
    """Counters of one generation. A prefill counts as one target forward (it emits the first token),
    so plain decoding has mean_accepted_length == 1.0 exactly, as in Spec-Bench."""

    num_target_forwards: int = 0
    num_draft_tokens: int = 0  # draft tokens offered to the verifier (tree nodes minus roots)
    num_accepted_tokens: int = 0  # draft tokens the verifier accepted
    num_suffix_draft_tokens: int = 0  # of num_draft_tokens, those the suffix index proposed
    num_suffix_accepted_tokens: int = 0  # of num_accepted_tokens, those the suffix index proposed
    num_forced_draft_tokens: int = 0  # of num_draft_tokens, those a constraint's grammar forced
    num_forced_accepted_tokens: int = 0  # of num_accepted_tokens, those a constraint's grammar forced
    num_generated_tokens: int = 0
    # of num_target_forwards, rounds the target ran on its own after a call's first (AheadVerifier)
    num_ahead_rounds: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache, not a forward
    elapsed_s: float = 0.0
    draft_s: float = 0.0  # time inside the drafter
    verify_s: float = 0.0  # time inside the verifier (target forward + acceptance + commit)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target forward (accepted + bonus); 1.0 for plain decoding."""
        return self.num_generated_tokens / self.num_target_forwards if self.num_target_forwards else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def to_dict(self) -> dict[str, float | int | None]:
        out: dict[str, float | int | None] = asdict(self)
        out.update(
            mean_accepted_length=self.mean_accepted_length,
            acceptance_rate=self.acceptance_rate,
            tokens_per_s=self.tokens_per_s,
        )
        return out


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the target (core/logprobs.py computes it)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens only (eos included when the model emitted it)
    text: str  # decoded generated text, special tokens skipped, cut before a matched stop string
    finish_reason: FinishReason
    stats: GenerationStats = field(default_factory=GenerationStats)
