"""Suffix drafting on characters: a copied span is found from its first token, however it was cut.

A served model that copies from its input rarely cuts the copy into the input's tokens. A JSON value
opens after a quote, so its first word has no leading space (`"Maria` against ` Maria` in the sentence),
and a model often starts a copied word with a shorter token than the text's (`"T`, `omas`, `z` against
` Tomasz`). The token-id index (core/suffix.py) then finds the copy only a token or two later, or never.

`TextSuffixIndex` matches the stream's characters instead. Each round, the longest suffix of the
session's text (prompt + committed tokens, as text) that occurred before is looked up; the characters
that followed its most recent occurrences are tokenized afresh, starting exactly where the stream ends,
and form the same scored trie as the token-id index's (`build_trie_proposal`). A tokenization that
starts mid-word gives the mid-word tokens a model writes when it continues a word (`imbus` -> `imb`,
`us`), which is what it was after.

Deterministic candidates, verified like any others: whatever this proposes, greedy output stays the
target's own and sampling keeps its distribution (core/verify.py's fixed-candidate rule).

Pure Python, no torch: the router drafts with it too. The text comes through a `TextCodec` (the serving
tokenizer; specserve/text_codec.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from specserve.core.suffix import SuffixProposal, build_trie_proposal
from specserve.errors import InvalidArgument


class TextCodec(Protocol):
    def token_text(self, token_id: int) -> str:
        """The characters token `token_id` adds to a text (as it reads in the middle of one)."""
        ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's tokens, as the tokenizer cuts a text with nothing before it (no special tokens)."""
        ...


@dataclass(frozen=True)
class TextMatchSettings:
    max_match_chars: int = 64  # longest suffix of the text looked up
    max_occurrences: int = 8  # most recent earlier occurrences whose continuations are tokenized
    continuation_chars: int = 48  # characters of each continuation tokenized (its last token dropped)
    window_chars: int = 32768  # only the text's most recent characters are searched

    def __post_init__(self) -> None:
        if min(self.max_match_chars, self.max_occurrences, self.continuation_chars) < 1:
            raise InvalidArgument("text match lengths and occurrences must be >= 1")
        if self.window_chars < self.max_match_chars + self.continuation_chars:
            raise InvalidArgument("the text window must hold a match and its continuation")


class TextSuffixIndex:
    """One session's stream as text, which drafts from its own earlier characters. Not thread-safe."""

    def __init__(self, codec: TextCodec, settings: TextMatchSettings = TextMatchSettings()) -> None:
        self.codec = codec
        self.settings = settings
        self.text = ""  # the stream's most recent characters (at most twice window_chars)
        self.num_tokens = 0  # tokens of the stream seen

    def __len__(self) -> int:
        return self.num_tokens

    def extend(self, token_ids: Sequence[int]) -> None:
        """Appends committed tokens."""
        if not token_ids:
            return
        text = self.text + "".join(self.codec.token_text(t) for t in token_ids)
        if len(text) > 2 * self.settings.window_chars:  # trimmed in halves: amortized O(1) per char
            text = text[len(text) - self.settings.window_chars :]
        self.text = text
        self.num_tokens += len(token_ids)

    def longest_match(self) -> int:
        """The length of the longest suffix of the searched text (at most max_match_chars) that also
        ends earlier in it; 0 when even its last character does not."""
        text = self._searched()
        end = len(text)

        def occurs(length: int) -> bool:  # an occurrence ending before `end`: inside text[: end - 1]
            return length < end and text.find(text[end - length :], 0, end - 1) >= 0

        # Doubling, then halving: a suffix that occurs earlier has every shorter suffix occurring too.
        low, high = 0, 1
        while high <= self.settings.max_match_chars and occurs(high):
            low, high = high, 2 * high
        high = min(high, self.settings.max_match_chars + 1)  # the shortest length known not to occur
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if occurs(middle) else (low, middle)
        return low

    def _searched(self) -> str:
        return self.text[-self.settings.window_chars :]

    def continuations(self) -> tuple[int, list[tuple[str, bool]]]:
        """The longest match's length and what followed its most recent earlier occurrences (newest
        first, non-empty, up to continuation_chars each), each with whether it runs to the text's end."""
        length = self.longest_match()
        if length == 0:
            return 0, []
        text = self._searched()
        end = len(text)
        suffix = text[end - length :]
        # An occurrence that starts as the match does, inside a word or at its start, is the likelier
        # source (`N` opening a value continues as `Nimbus` did, not as `JSON`): those go first, and
        # the others only when there are none.
        in_word = _in_word(text, end - length)
        found: list[tuple[str, bool]] = []
        others: list[tuple[str, bool]] = []
        stop = end - 1  # occurrences lie inside text[:stop]
        looked, most = 0, self.settings.max_occurrences
        while len(found) < most and looked < 4 * most:  # a common suffix: the newest few only
            looked += 1
            start = text.rfind(suffix, 0, stop)
            if start < 0:
                break
            after = start + length
            until = min(after + self.settings.continuation_chars, end)
            if until > after:
                kept = found if _in_word(text, start) == in_word else others
                kept.append((text[after:until], until == end))
            stop = start + length - 1  # the next one ends earlier (overlaps allowed)
        return length, found or others[: self.settings.max_occurrences]

    def propose(
        self, root_token: int, max_depth: int, max_nodes: int, min_score: float = 0.0
    ) -> SuffixProposal | None:
        """The continuations, tokenized from where the stream ends, as a scored trie rooted at
        root_token (the stream's last token). None when nothing matched or no node stays."""
        if max_depth < 0 or max_nodes < 0:
            raise InvalidArgument(f"max_depth and max_nodes must be >= 0, got {max_depth} and {max_nodes}")
        if max_depth == 0 or max_nodes == 0:
            return None
        length, found = self.continuations()
        if not found:
            return None
        tokenized = self.codec.encode_batch([text for text, _ in found])
        paths: list[list[int]] = []
        for (_, to_end), tokens in zip(found, tokenized, strict=True):
            # A continuation cut short may end in part of a word, so its last token is not trusted; one
            # that runs to the stream's end stops where a committed token did.
            kept = tokens if to_end else tokens[:-1]
            if kept:
                paths.append(kept[:max_depth])
        if not paths:
            return None
        return build_trie_proposal(root_token, paths, length, max_nodes, min_score)


def _in_word(text: str, start: int) -> bool:
    """Whether text[start] continues a word (a letter or digit is right before it)."""
    return start > 0 and text[start - 1].isalnum()
