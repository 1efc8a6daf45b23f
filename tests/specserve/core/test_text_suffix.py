"""Suffix drafting on characters (core/text_suffix.py): a copy is found however its tokens were cut."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from specserve.core.suffix import SuffixIndex
from specserve.core.suffix_drafter import SuffixDrafter
from specserve.core.text_suffix import TextMatchSettings, TextSuffixIndex
from specserve.errors import InvalidArgument
from specserve.text_codec import TokenizerCodec


class GreedyCodec:
    """A toy tokenizer: the longest vocabulary entry at each position (every single character is one)."""

    def __init__(self, words: Sequence[str]) -> None:
        chars = sorted({*(chr(c) for c in range(32, 127)), "\n", *(c for w in words for c in w)})
        self.vocab = [*chars, *(w for w in words if len(w) > 1)]
        self.ids = {text: i for i, text in enumerate(self.vocab)}
        self.longest = max(map(len, self.vocab))
        self.encoded: list[str] = []  # every text asked for, in order

    def token_text(self, token_id: int) -> str:
        return self.vocab[token_id]

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            n = next(n for n in range(min(self.longest, len(text) - i), 0, -1) if text[i : i + n] in self.ids)
            ids.append(self.ids[text[i : i + n]])
            i += n
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        self.encoded.extend(texts)
        return [self.encode(t) for t in texts]

    def texts(self, ids: Sequence[int]) -> list[str]:
        return [self.vocab[i] for i in ids]


WORDS = [" Maria", " Lopez", " is", " an", " architect", ".", '"', "Ma", "ria", "Nimbus", " JSON", " X2"]


def test_a_copy_cut_into_other_tokens_is_found_from_its_first_token():
    codec = GreedyCodec(WORDS)
    prompt = codec.encode("Hi Maria Lopez is an architect.\n")  # " Maria", then " Lopez"
    answer = [codec.ids['"'], codec.ids["Ma"], codec.ids["ria"]]  # the model wrote `"`, `Ma`, `ria`
    stream = [*prompt, *answer]
    by_ids = SuffixIndex()
    by_ids.extend(stream)
    assert by_ids.propose(4, 8) is None  # `ria` never followed anything: the ids find no copy
    index = TextSuffixIndex(codec, TextMatchSettings(continuation_chars=13))
    index.extend(stream)
    proposal = index.propose(stream[-1], max_depth=4, max_nodes=8)
    assert proposal is not None and proposal.match_length == len("Maria")
    # " Lopez is an " (13 characters): its last token may be a part of a word (" architect") and is dropped
    assert codec.texts(proposal.tree.token_ids) == ["ria", " Lopez", " is", " an"]
    assert proposal.tree.is_chain() and proposal.scores == (1.0, 1.0, 1.0, 1.0)


def test_the_longest_earlier_suffix_decides_and_several_occurrences_share_the_trie():
    codec = GreedyCodec(["ab", "cd", "xy"])
    index = TextSuffixIndex(codec)
    index.extend(codec.encode("zab.xab.zab-xab"))
    assert index.longest_match() == len("xab")  # "xab" occurred once before; "-xab" never did
    length, found = index.continuations()
    assert length == 3 and found == [(".zab-xab", True)]  # runs to the text's end: kept whole
    index.extend(codec.encode("!ab"))  # "!ab" is new; "ab" occurred 4 times, each inside a word
    proposal = index.propose(codec.ids["ab"], max_depth=1, max_nodes=8)
    assert proposal is not None and proposal.match_length == 2
    scored = zip(codec.texts(proposal.tree.token_ids[1:]), proposal.scores[1:], strict=True)
    assert sorted(scored) == [("!", 0.25), ("-", 0.25), (".", 0.5)]


def test_a_match_opening_a_word_continues_from_words_that_open_the_same_way():
    # `"N` opens a value: the `N` of "Nimbus" is the source, not the one inside " JSON", which is newer.
    codec = GreedyCodec(WORDS)
    stream = [*codec.encode("Nimbus X2. Write JSON."), codec.ids['"'], codec.ids["N"]]
    index = TextSuffixIndex(codec, TextMatchSettings(continuation_chars=8))
    index.extend(stream)
    assert index.longest_match() == 1
    assert index.continuations()[1] == [("imbus X2", False)]
    # with no occurrence opening a word, the others are taken
    inside = TextSuffixIndex(codec, TextMatchSettings(continuation_chars=3))
    inside.extend([*codec.encode("aN.b"), codec.ids["N"]])
    assert inside.continuations()[1] == [(".bN", True)]


def test_nothing_is_proposed_without_an_earlier_occurrence_or_room():
    codec = GreedyCodec(["ab"])
    index = TextSuffixIndex(codec)
    assert index.propose(0, 4, 8) is None  # an empty stream
    index.extend(codec.encode("abc"))
    assert index.longest_match() == 0 and index.propose(codec.ids["c"], 4, 8) is None
    index.extend(codec.encode("ab"))
    assert index.propose(codec.ids["ab"], 0, 8) is None and index.propose(codec.ids["ab"], 4, 0) is None
    assert codec.encoded == []  # nothing was tokenized for those
    with pytest.raises(InvalidArgument):
        index.propose(0, -1, 8)


def test_matches_and_occurrences_are_bounded():
    codec = GreedyCodec(["ab"])
    settings = TextMatchSettings(max_match_chars=4, max_occurrences=3, continuation_chars=2, window_chars=64)
    index = TextSuffixIndex(codec, settings)
    index.extend(codec.encode("abcdefgh" * 40))  # 320 characters
    assert len(index.text) <= 2 * settings.window_chars and len(index) == len(codec.encode("abcdefgh" * 40))
    assert index.longest_match() == 4  # every suffix occurred before; the lookup stops at 4
    assert len(index.continuations()[1]) == 3
    with pytest.raises(InvalidArgument):
        TextMatchSettings(window_chars=10)


@pytest.fixture(scope="module")
def codec(default_model_dir: Path) -> TokenizerCodec:
    return TokenizerCodec.from_json((default_model_dir / "tokenizer.json").read_text())


def test_the_serving_tokenizer_reads_token_by_token_as_the_whole_text(codec: TokenizerCodec):
    text = 'The Nimbus X2 costs $129.99.\n{"name": "Nimbus X2", "colors": ["blue"]}'
    ids = codec.tokenizer.encode(text, add_special_tokens=False).ids
    assert "".join(codec.token_text(t) for t in ids) == text


def test_a_json_value_is_drafted_from_its_first_letter(codec: TokenizerCodec):
    # The served model opens the value with `N` (the text has ` N`, `imb`, `us`): its next tokens are the
    # text's, cut from the middle of the word as a model continues one.
    tokens = codec.tokenizer.encode
    stream = tokens("Extract as JSON: The Nimbus X2 running shoe.\n", add_special_tokens=False).ids
    stream += tokens('{"name": "N', add_special_tokens=False).ids
    index = TextSuffixIndex(codec)
    index.extend(stream)
    proposal = index.propose(stream[-1], max_depth=4, max_nodes=8)
    assert proposal is not None
    assert [codec.token_text(t) for t in proposal.tree.token_ids] == ["N", "imb", "us", " X", "2"]


def test_a_constrained_suffix_drafter_matches_characters_where_the_ids_find_nothing():
    codec = GreedyCodec(WORDS)
    prompt = codec.encode("Hi Maria Lopez is an architect.\n")
    cut = [*prompt, codec.ids['"'], codec.ids["Ma"], codec.ids["ria"]]
    drafter = SuffixDrafter(None, 16, None, codec=codec)
    assert drafter.propose(cut, 0, 1).tree.num_nodes == 1  # unconstrained: the ids only
    drafter.constrain(OpenGrammar())
    by_ids = drafter.propose([*prompt, *codec.encode(" Maria")], 0, 1)  # the ids find " Lopez"
    assert codec.texts(by_ids.tree.token_ids[1:3]) == [" Lopez", " is"] and codec.encoded == []
    by_text = drafter.propose(cut, 1, 1)
    assert codec.texts(by_text.tree.token_ids[1:3]) == [" Lopez", " is"] and codec.encoded
    assert by_text.suffix_nodes == frozenset(range(1, by_text.tree.num_nodes))
    without = SuffixDrafter(None, 16, None)
    without.constrain(OpenGrammar())
    assert without.propose(cut, 1, 1).tree.num_nodes == 1  # no codec, no characters


class OpenGrammar:
    """A GrammarState that allows everything (what SuffixDrafter.constrain is given)."""

    max_tree_nodes = 64

    def sync(self, token_ids: Sequence[int]) -> None: ...

    def push(self, tokens: Sequence[int]) -> None: ...

    def pop(self, count: int) -> None: ...

    def allowed_prefix(self, tokens: Sequence[int]) -> int:
        return len(tokens)

    def forced(self) -> list[int]:
        return []

    def bitmask(self) -> bytes:
        return b"\xff" * 8
