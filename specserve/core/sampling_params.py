"""Per-request sampling parameters, validated once at the edge."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.errors import InvalidArgument

# Bounds every request must respect; services and the CLI share them. The new-token cap is the default
# of EngineSettings.max_new_tokens_limit (SPECSERVE_MAX_NEW_TOKENS_LIMIT), which the services report.
MAX_NEW_TOKENS_LIMIT = 4096
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next-token distribution is turned into a choice.

    temperature == 0 means greedy. top_k == 0 disables top-k; top_p == 1 disables top-p. The same
    processing is applied to target and draft logits, so verification stays lossless.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_new_tokens: int = 128
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    allow_lossy: bool = False  # opt in to a lossy method (MethodSpec.lossless False) at T > 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, max_new_tokens_limit: int = MAX_NEW_TOKENS_LIMIT) -> SamplingParams:
        if not self.temperature >= 0.0 or self.temperature != self.temperature:
            raise InvalidArgument(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0, got {self.top_k}")
        if not 1 <= self.max_new_tokens <= max_new_tokens_limit:
            raise InvalidArgument(
                f"max_new_tokens must be in [1, {max_new_tokens_limit}], got {self.max_new_tokens}"
            )
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidArgument(f"seed must be in [0, 2**63), got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidArgument(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidArgument(f"stop strings must have 1..{MAX_STOP_STRING_CHARS} characters")
        return self
