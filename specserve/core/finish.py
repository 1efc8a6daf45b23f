"""When a generation ends: eos, the token budget, or a stop string. Cuts a block of new tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specserve.core.request import StoppingParams
from specserve.results import FinishReason


@dataclass
class FinishChecker:
    """A generation's stop logic. The engine and the router both make it with `for_request`, feed it
    every accepted block (`extend`) and take `final_text` at the end."""

    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    decode: Callable[[Sequence[int]], str] | None = None  # needed only for stop strings
    generated: list[int] = field(default_factory=list)
    reason: FinishReason | None = None
    stop_text_end: int | None = None  # where the text is cut when a stop string matched

    @classmethod
    def for_request(
        cls,
        stopping: StoppingParams,
        eos_token_ids: frozenset[int],
        decode: Callable[[Sequence[int]], str],
    ) -> FinishChecker:
        eos = frozenset() if stopping.ignore_eos else eos_token_ids
        return cls(stopping.max_new_tokens, eos, stopping.stop, decode)

    def extend(self, new_tokens: Sequence[int]) -> list[int]:
        """Appends new tokens up to the first finishing one; returns the tokens kept."""
        kept: list[int] = []
        for token in new_tokens:
            kept.append(token)
            self.generated.append(token)
            if token in self.eos_token_ids:
                self.reason = FinishReason.EOS
                break
            if len(self.generated) >= self.max_new_tokens:
                self.reason = FinishReason.LENGTH
                break
        if self.stop_strings:
            kept = self._cut_at_stop_string(kept)
        return kept

    def _cut_at_stop_string(self, kept: list[int]) -> list[int]:
        assert self.decode is not None, "stop strings need a decode function"
        text = self.decode(self.generated)
        hits = [(text.find(s), s) for s in self.stop_strings if s in text]
        if not hits:
            return kept
        start, stop = min(hits)
        # Keep the fewest tokens whose text contains the stop string (the block may run past it).
        first_new = len(self.generated) - len(kept)
        for n in range(first_new + 1, len(self.generated) + 1):
            if stop in self.decode(self.generated[:n]):
                break
        dropped = len(self.generated) - n
        del self.generated[n:]
        self.reason = FinishReason.STOP
        self.stop_text_end = start
        return kept[: len(kept) - dropped]

    @property
    def done(self) -> bool:
        return self.reason is not None

    @property
    def tokens_left(self) -> int:
        """Tokens the request may still generate (its max_new_tokens less those generated)."""
        return max(0, self.max_new_tokens - len(self.generated))

    def final_text(self) -> str:
        """The generated text, special tokens skipped, cut before a matched stop string."""
        assert self.decode is not None, "the final text needs a decode function"
        text = self.decode(self.generated)
        return text if self.stop_text_end is None else text[: self.stop_text_end]
