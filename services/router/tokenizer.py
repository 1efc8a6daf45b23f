"""Prompt encoding and incremental decoding in the router, from the target's ModelInfo alone.

The router has no torch, so no transformers: the `tokenizers` library reads the target's tokenizer.json,
and the chat template is rendered with Jinja the way transformers renders it (a sandboxed environment,
trim_blocks and lstrip_blocks, loop controls, its `tojson`, generation prompt appended), then encoded
without extra special tokens.
A test checks the result equals the engine's own encoding.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2.ext
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from specserve.errors import InvalidArgument
from specserve.grammar import GrammarCompiler
from specserve.text_codec import TokenizerCodec
from specserve.v1 import target_pb2


def _raise(message: str) -> None:
    raise InvalidArgument(f"chat template: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' `tojson` (Jinja's own sorts keys and escapes <, > and &): templates write tools and
    call arguments with it, and the model was trained on its output."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class RouterTokenizer:
    def __init__(self, info: target_pb2.ModelInfo) -> None:
        self.tokenizer = Tokenizer.from_str(info.tokenizer_json)
        # The most characters one token covers (bounds a prompt's length before it is tokenized).
        self.max_token_chars = max(map(len, self.tokenizer.get_vocab(with_added_tokens=True)))
        self.info = info
        self.template = None
        # The template renders `tools` itself, and calls in the HTTP API's format (services/router/http/
        # tools.py): then tools, calls and tool messages are passed to it as transformers passes them.
        self.native_tools = False
        if info.chat_template:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise
            self.template = env.from_string(info.chat_template)
            variables = meta.find_undeclared_variables(env.parse(info.chat_template))
            self.native_tools = "tools" in variables and "<tool_call>" in info.chat_template

    @functools.cached_property
    def codec(self) -> TokenizerCodec:
        """Token texts and encoding for suffix candidates matched on characters (core/text_suffix.py)."""
        return TokenizerCodec(self.tokenizer)

    @functools.cached_property
    def grammar_compiler(self) -> GrammarCompiler:
        """Constraints compiled against the target's tokenizer: the router shapes drafts with them."""
        return GrammarCompiler(self.info.tokenizer_json, self.info.eos_token_ids)

    def encode_prompt(self, user_message: str) -> list[int]:
        if not user_message.strip():
            raise InvalidArgument("the prompt is empty")
        return self.encode_chat([{"role": "user", "content": user_message}])

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        """A conversation ({"role", "content"} dicts, any number of turns; with `native_tools`, also
        calls and tool messages) through the chat template, with the assistant's turn opened. `tools`:
        the functions (templates with `native_tools` only). Without a template the contents are joined by
        newlines."""
        if not any((m.get("content") or "").strip() for m in messages):
            raise InvalidArgument("the messages are empty")
        if self.template is None:
            return self.tokenizer.encode("\n".join(m.get("content") or "" for m in messages)).ids
        extra = {"tools": list(tools)} if tools else {}
        text = self.template.render(
            messages=list(messages),
            add_generation_prompt=True,
            bos_token=self.info.bos_token,
            eos_token=self.info.eos_token,
            **extra,
        )
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        """Raw text, no template (the completions API's prompt)."""
        if not text:
            raise InvalidArgument("the prompt is empty")
        return self.tokenizer.encode(text).ids

    def token_text(self, token_id: int) -> str:
        """One token's own text (special tokens included; a partial UTF-8 character shows as U+FFFD)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)


INCOMPLETE = "\ufffd"  # what decoding yields for the bytes of a character whose last bytes are missing


class IncrementalText:
    """Text deltas of a growing token sequence, as a stream sends them.

    Holds back an incomplete UTF-8 character and, with stop strings, anything that could still become
    one; the text ends before the first stop string. What was sent is always `visible(tokens)`, a function
    of the tokens alone, however they were chunked, so a stream resumed after any token count continues
    the client's text exactly.
    """

    def __init__(
        self, tokenizer: RouterTokenizer, token_ids: Sequence[int] = (), stops: Sequence[str] = ()
    ) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.token_ids = list(token_ids)
        self.sent = self.visible(self.token_ids) if self.token_ids else ""

    def visible(self, token_ids: Sequence[int], final: bool = False) -> str:
        """The text of `token_ids` a client may see: cut before the first stop string; unless `final`
        (the generation ended), without a trailing incomplete character or a possible stop's start."""
        text = self.tokenizer.decode(token_ids)
        if not final:
            text = text.rstrip(INCOMPLETE)
        hits = [text.find(s) for s in self.stops if s in text]
        if hits:
            return text[: min(hits)]
        if not final:
            held = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[: len(text) - held]
        return text

    def add(self, new_token_ids: Sequence[int], final_text: str | None = None) -> str:
        """final_text: the finished text (cut before a stop string), sent in full at the end."""
        self.token_ids.extend(new_token_ids)
        text = self.visible(self.token_ids) if final_text is None else final_text
        if not text.startswith(self.sent):  # cannot happen: what was sent never needs taking back
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta
