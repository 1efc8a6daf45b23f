"""How the HTTP API turns rounds of tokens into text (services/router/http/generation.py): a stop string
never shows, not even its first characters while it could still be one; an incomplete UTF-8 character
is held back; each round's text splits into the draft's accepted part and the target's own.

The tokenizer is the default model's, read from its files the way the router gets them (ModelInfo).
"""

from __future__ import annotations

import json

import pytest

from services.router.http.generation import TextAssembler
from services.router.tokenizer import IncrementalText, RouterTokenizer
from specserve.v1 import target_pb2

TEXT = "In the heart of the night, a gentle rain 🌧️ falls on 日本の庭. A gentle rain, again."


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> RouterTokenizer:
    config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    info = target_pb2.ModelInfo(
        tokenizer_json=(default_model_dir / "tokenizer.json").read_text(),
        chat_template=(default_model_dir / "chat_template.jinja").read_text(),
        bos_token=config["bos_token"],
        eos_token=config["eos_token"],
    )
    return RouterTokenizer(info)


def rounds_of(token_ids: list[int], size: int) -> list[list[int]]:
    return [token_ids[i : i + size] for i in range(0, len(token_ids), size)]


@pytest.mark.parametrize("round_size", [1, 2, 5])
def test_the_text_stops_before_the_stop_string_and_never_shows_part_of_it(tokenizer, round_size) -> None:
    stop = "gentle rain"
    expected = TEXT[: TEXT.index(stop)]
    text = TextAssembler(tokenizer, [stop, "never there"])
    for token_ids in rounds_of(tokenizer.encode_text(TEXT), round_size):
        text.add(token_ids, num_accepted=len(token_ids) - 1)
        assert expected.startswith(text.text), "sent text that the stop string later cut"
        assert "\ufffd" not in text.text
    text.finish()
    assert text.text == expected


def test_without_stops_everything_arrives_and_splits_by_origin(tokenizer) -> None:
    token_ids = tokenizer.encode_text(TEXT)
    text = TextAssembler(tokenizer)
    pieces = []
    for chunk in rounds_of(token_ids, 3):
        accepted, target, from_suffix = text.add(chunk, num_accepted=2, num_suffix=1)
        assert accepted.endswith(from_suffix)  # the suffix index's tokens end the accepted path
        pieces.append((accepted, target))
        assert "\ufffd" not in accepted + target  # the emoji's bytes span tokens: held back, never split
    rest = text.finish()
    assert "".join(a + t for a, t in pieces) + rest == TEXT == text.text
    # The first round: its first two tokens came from the draft, the third is the target's own.
    assert pieces[0][0] == tokenizer.decode(token_ids[:2]) and pieces[0][1] == tokenizer.decode(
        token_ids[2:3]
    )


def test_a_stream_resumed_anywhere_continues_the_text_exactly_with_stops(tokenizer) -> None:
    """The router resumes a session with IncrementalText(tokenizer, received, stops): whatever the cut,
    the client's text plus the resumed deltas is the finished text, cut before the stop string."""
    stop = "gentle rain"
    token_ids = tokenizer.encode_text(TEXT)
    finished = IncrementalText(tokenizer, stops=[stop]).visible(token_ids, final=True)
    assert finished == TEXT[: TEXT.index(stop)]
    for cut in range(len(token_ids) + 1):
        before = IncrementalText(tokenizer, stops=[stop])
        client = "".join(before.add([t]) for t in token_ids[:cut])
        resumed = IncrementalText(tokenizer, token_ids[:cut], stops=[stop])
        client += "".join(resumed.add([t]) for t in token_ids[cut:])
        client += resumed.add([], final_text=finished)
        assert client == finished, cut


def test_a_conversation_goes_through_the_chat_template(tokenizer) -> None:
    one_turn = tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    assert one_turn == tokenizer.encode_prompt("Hi")
    rendered = tokenizer.tokenizer.decode(
        tokenizer.encode_chat(
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Bye"},
            ]
        ),
        skip_special_tokens=False,
    )
    assert rendered.index("Be brief.") < rendered.index("Hello.") < rendered.index("Bye")
    assert rendered.endswith("<|im_start|>assistant\n")
