"""A serving tokenizer as core/text_suffix.py's `TextCodec`, for the engine and the router alike (both
hold the `tokenizers` library's tokenizer; neither needs transformers or torch for this)."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer


class TokenizerCodec:
    """Token texts, cached per id (a session asks for the same few thousand), and batch encoding."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        # A token's text is read after an anchor: some decoders drop a leading space at a text's start
        # (SentencePiece's), which the same token keeps in the middle of a text.
        anchor = tokenizer.encode("a", add_special_tokens=False).ids
        self._anchor = anchor[:1]
        self._anchor_text = tokenizer.decode(self._anchor, skip_special_tokens=False)

    @classmethod
    def from_json(cls, tokenizer_json: str) -> TokenizerCodec:
        return cls(Tokenizer.from_str(tokenizer_json))

    def token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            both = self.tokenizer.decode([*self._anchor, token_id], skip_special_tokens=False)
            anchored = both.startswith(self._anchor_text) and bool(self._anchor)
            text = both[len(self._anchor_text) :] if anchored else self.tokenizer.decode([token_id])
            self._texts[token_id] = text
        return text

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [encoding.ids for encoding in encodings]
