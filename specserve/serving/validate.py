"""Checks on what callers send that need more than the message itself: the vocabulary, the session the
service holds, its configured peers. Pure functions, torch-free; each raises InvalidArgument (or
PermissionDenied for a peer the service was not configured to trust) with a message for the caller.

The handlers call them first thing, so a bad id never reaches a tensor index (where it would surface as
INTERNAL) and a prompt is never tokenized before its size is known to be sane.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence

from specserve.errors import FailedPrecondition, InvalidArgument, PermissionDenied


def check_token_ids(token_ids: Sequence[int], vocab_size: int, what: str = "token ids") -> None:
    """Every id in [0, vocab_size): embedding lookups index with them."""
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise InvalidArgument(f"{what} must be in [0, {vocab_size})")


def prompt_char_limit(max_prompt_tokens: int, max_token_chars: int) -> int:
    """The most characters a prompt of `max_prompt_tokens` tokens can have.

    No token of the vocabulary covers more than `max_token_chars` characters, so a prompt longer than
    max_prompt_tokens * max_token_chars has more tokens than allowed whatever the tokenizer does, and
    tokenizing megabytes to find that out would hold a worker (and everyone queued behind it) for seconds.
    """
    return max_prompt_tokens * max(1, max_token_chars)


def check_prompt_chars(prompt: str, max_prompt_tokens: int, max_token_chars: int) -> None:
    """Rejects a prompt that cannot fit `max_prompt_tokens` before tokenizing it."""
    check_prompt_length(len(prompt), max_prompt_tokens, max_token_chars)


def check_prompt_length(num_chars: int, max_prompt_tokens: int, max_token_chars: int) -> None:
    """`check_prompt_chars` for a prompt of `num_chars` characters: for a conversation, its contents
    together (the chat template puts each of them in the text it tokenizes)."""
    if num_chars > prompt_char_limit(max_prompt_tokens, max_token_chars):
        raise InvalidArgument(
            f"the prompt has {num_chars} characters; more than {max_prompt_tokens} tokens can hold"
        )


def check_rebuild(
    token_ids: Sequence[int], root_token: int, vocab_size: int, held: Sequence[int] | None
) -> None:
    """A target Prefill that rebuilds a session (token_ids and the root) from the router's history.

    `held` is the history the target still holds for that session id, if any. A legitimate rebuild
    agrees with it on every position both have (the router may be behind, after a lost Verify
    response, or the target may have been rebuilt shorter); one that disagrees would silently change
    another session's output, so it is refused.
    """
    if not 0 <= root_token < vocab_size:
        raise InvalidArgument(f"root_token must be in [0, {vocab_size}), got {root_token}")
    if not held:
        return
    history = [*token_ids, root_token]
    common = min(len(history), len(held))
    if list(history[:common]) != list(held[:common]):
        raise FailedPrecondition("the rebuild disagrees with the history this session holds")


DNS_SCHEME = "dns:///"
RESOLVE_EVERY_SECONDS = 5.0
_resolved: dict[str, tuple[float, frozenset[str]]] = {}  # dns:/// entry -> (when, its ip:port addresses)


def check_target_address(address: str, allowed: Sequence[str]) -> None:
    """The draft dials only targets from its own configuration (never an address a caller made up).

    An entry `dns:///host:port` allows every address the name resolves to (`ip:port`, IPv6 in brackets:
    how the router names the replicas it expands from the same entry), re-resolved every few seconds.
    """
    if address in allowed:
        return
    if any(address in _resolve(entry) for entry in allowed if entry.startswith(DNS_SCHEME)):
        return
    raise PermissionDenied("target_address is not one of this draft's configured targets")


def _resolve(entry: str) -> frozenset[str]:
    now = time.monotonic()
    cached = _resolved.get(entry)
    if cached is not None and now - cached[0] < RESOLVE_EVERY_SECONDS:
        return cached[1]
    host, _, port = entry.removeprefix(DNS_SCHEME).rpartition(":")
    try:
        infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError):
        infos = []
    addresses = frozenset(
        f"[{info[4][0]}]:{port}" if info[0] == socket.AF_INET6 else f"{info[4][0]}:{port}" for info in infos
    )
    if addresses or cached is None:  # keep the last good answer through a DNS hiccup
        _resolved[entry] = (now, addresses)
    return _resolved[entry][1]
