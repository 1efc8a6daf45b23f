"""A session's place in its constraint's language, kept in step with the committed tokens.

A guide follows the generated text only (the prompt is not in the language): `sync` consumes the
committed tokens it has not seen, so every holder (the loop that shapes drafts, the verifier that masks
the target) catches up from the same token history, and a resumed or rebuilt session replays its
generated tokens. Walking a draft tree pushes a path's tokens and pops them again.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance

from specserve.errors import FailedPrecondition


class Guide:
    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        num_prompt_tokens: int,
        max_tree_nodes: int = 64,
        tokenizer: llguidance.LLTokenizer | None = None,
    ) -> None:
        self.matcher = matcher
        self.tokenizer = tokenizer  # spells the forced text past the tokens it forces (`forced`)
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tree_nodes = max_tree_nodes  # the most nodes a shaped draft may have (core/grammar.py)
        self.num_consumed = 0  # generated tokens consumed, pushed path tokens included
        # Per consumed token, whether the matcher keeps it for rollback: the end of sequence taken once the
        # language is complete is not kept (rolling it back as a token would undo one token too many).
        self._kept: list[bool] = []

    def sync(self, token_ids: Sequence[int]) -> None:
        """Consumes the generated tokens of `token_ids` (prompt, then generated) not consumed yet."""
        pending = list(token_ids[self.num_prompt_tokens + self.num_consumed :])
        if pending:
            self.push(pending)

    def push(self, tokens: Sequence[int]) -> None:
        """Advances over `tokens`; FailedPrecondition if the language does not allow them (a token that
        was committed unmasked, or a corrupted session)."""
        for token in tokens:
            # One at a time: a batch ending in the end-of-sequence token is refused once the language is
            # complete, where the token alone is taken.
            complete = bool(self.matcher.is_stopped())
            if not self.matcher.consume_token(token):
                raise FailedPrecondition(f"the constraint does not allow token {token} here")
            self._kept.append(not complete)
            self.num_consumed += 1

    def pop(self, count: int) -> None:
        """Undoes the last `count` tokens pushed."""
        if count <= 0:
            return
        kept = sum(self._kept[-count:])
        del self._kept[-count:]
        if kept and not self.matcher.rollback(kept):
            raise FailedPrecondition("the constraint could not step back")
        self.num_consumed -= count

    def allowed_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order from here, the language allows (nothing is consumed)."""
        return int(self.matcher.validate_tokens(list(tokens))) if tokens else 0

    def forced(self) -> list[int]:
        """The continuation the language forces from here, in the tokenizer's canonical tokens (the
        target may still spell it otherwise: these are drafts, verified like any other).

        The matcher forces tokens only as far as no longer token could start there; the text it forces
        goes on (after `":` a string value's ` "`, which a token such as ` "T` could also begin).
        With the tokenizer, that rest is drafted too, in its canonical tokens: the likeliest spelling,
        and the first token the model chooses for itself comes a token later."""
        tokens = list(self.matcher.compute_ff_tokens())
        if self.tokenizer is None:
            return tokens
        text = bytes(self.matcher.compute_ff_bytes())
        spelled = bytes(self.tokenizer.decode_bytes(tokens))
        if len(text) > len(spelled) and text.startswith(spelled):
            tokens += self.tokenizer.tokenize_bytes(text[len(spelled) :])
        return tokens

    def bitmask(self) -> bytes:
        """The tokens allowed next: bit i of the little-endian 32-bit words is token i."""
        return bytes(self.matcher.compute_bitmask())

    @property
    def done(self) -> bool:
        """The language is complete: nothing may follow but the end of sequence."""
        return bool(self.matcher.is_stopped())
