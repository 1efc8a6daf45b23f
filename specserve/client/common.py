"""What the sync and asyncio clients share: request building and response types."""

from __future__ import annotations

import random
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import TypedDict

from specserve.core.constraint import Constraint
from specserve.serving.convert import constraint_to_pb
from specserve.v1 import common_pb2, router_pb2

_FINISH = {
    common_pb2.FINISH_REASON_EOS: "eos",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_CANCELLED: "cancelled",
}
# How long a stream keeps retrying UNAVAILABLE since it last received anything. A supervised router
# is back within seconds (`specserve stack` restarts it after 1 s; it serves about 2 s later), and its
# Resume may then wait up to 7 s for the dead router's Redis lease to expire (services/router/state.py):
# 30 s covers that with room for a slower start or a second restart in its backoff.
RETRY_SECONDS = 30.0
RETRY_BACKOFF_SECONDS = (0.1, 0.25, 0.5, 1.0)  # before the Nth retry in a row; the last for all later ones
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # the services' default limit
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # A channel whose server went away fails every call at once until its next connection attempt, which
    # gRPC spaces 1, 1.6, 2.6, 4.1, ... up to 120 s apart: after a 5 s restart the retries above would
    # find the channel still waiting for several seconds more. Attempts at most 1 s apart follow the
    # router back as soon as it listens.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


@dataclass(frozen=True)
class Round:
    """One speculative round: the chunk's first num_accepted_tokens tokens are draft tokens the target
    accepted, the rest (usually one) is the target's own token."""

    num_draft_tokens: int
    num_accepted_tokens: int
    # Of each, the tokens the session's suffix index proposed (no draft model); the accepted ones are
    # the last of the accepted tokens.
    num_suffix_draft_tokens: int = 0
    num_suffix_accepted_tokens: int = 0
    # Under a constraint: of each, the tokens its grammar forced (its only continuation); the accepted
    # ones are the last of the accepted tokens (the suffix index's come just before them).
    num_forced_draft_tokens: int = 0
    num_forced_accepted_tokens: int = 0


@dataclass(frozen=True)
class Chunk:
    """Tokens as they are accepted, one chunk per round. finish_reason and stats are set on the last
    chunk only; round on chunks that carry one round's tokens (not on tokens re-sent after a resume)."""

    session_id: str
    token_ids: list[int]
    index: int  # position of token_ids[0] in the generated sequence
    text: str
    finish_reason: str | None = None
    stats: dict[str, float] = field(default_factory=dict)
    round: Round | None = None


@dataclass
class Completion:
    session_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict[str, float]


class RetryBudget:
    """When a stream broken by UNAVAILABLE (a router restarting, going away, or waiting out a lease) is
    retried: for up to `seconds` since it last received a message, at most `max_retries` times in a row
    (None: the time alone counts), never past the generation's own deadline. Each retry resumes the
    session where the stream stopped, so the budget restarts with every message received."""

    def __init__(self, seconds: float, max_retries: int | None = None) -> None:
        self.seconds, self.max_retries = seconds, max_retries
        self._since: float | None = None  # the first failure since the last message
        self._in_a_row = 0

    def received(self) -> None:
        self._since, self._in_a_row = None, 0

    def delay(self, unavailable: bool, deadline: float | None) -> float | None:
        """Seconds to wait before the next attempt, or None to give up (the error goes to the caller)."""
        now = time.monotonic()
        if self._since is None:
            self._since = now
        if not unavailable or (self.max_retries is not None and self._in_a_row >= self.max_retries):
            return None
        left = self.seconds - (now - self._since)
        if left <= 0:
            return None
        backoff = RETRY_BACKOFF_SECONDS[min(self._in_a_row, len(RETRY_BACKOFF_SECONDS) - 1)]
        # Jitter: clients that lost the same router do not all come back in the same instant. The last
        # attempt is made as the budget ends.
        wait = min(backoff * random.uniform(0.8, 1.2), left)
        if deadline is not None and now + wait >= deadline:
            return None
        self._in_a_row += 1
        return wait


class GenerateOptions(TypedDict, total=False):
    """What a generation may set besides its prompt; `generate_request` holds the defaults."""

    max_new_tokens: int
    method: str
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str] | tuple[str, ...]
    ignore_eos: bool
    session_id: str | None
    constraint: Constraint | None


def generate_request(
    prompt: str | list[int],
    *,
    max_new_tokens: int = 128,
    method: str = "",
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: list[str] | tuple[str, ...] = (),
    ignore_eos: bool = False,
    session_id: str | None = None,
    constraint: Constraint | None = None,
) -> router_pb2.GenerateRequest:
    """method "" = the router's default; seed None = a fresh one; session_id None = a fresh id;
    constraint: the language the text must belong to (`json_schema_constraint({...})`,
    `Constraint(ConstraintKind.REGEX, ...)`, ...), None = unconstrained."""
    # A seed fixed here makes a retried generation reproduce the tokens already received.
    sampling = common_pb2.SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, seed=secrets.randbits(63) if seed is None else seed
    )
    request = router_pb2.GenerateRequest(
        sampling=sampling,
        max_new_tokens=max_new_tokens,
        stop=list(stop),
        ignore_eos=ignore_eos,
        method=method,
        # Chosen here, so a retry after a lost connection can resume instead of starting over.
        session_id=session_id or uuid.uuid4().hex,
        constraint=constraint_to_pb(constraint),
    )
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_token_ids.extend(prompt)
    return request


def to_chunk(message: router_pb2.GenerateResponse) -> Chunk:
    stats = {}
    if message.HasField("stats"):
        stats = {f.name: getattr(message.stats, f.name) for f in message.stats.DESCRIPTOR.fields}
    return Chunk(
        session_id=message.session_id,
        token_ids=list(message.token_ids),
        index=message.index,
        text=message.text,
        finish_reason=_FINISH.get(message.finish_reason),
        stats=stats,
        round=Round(
            message.round.num_draft_tokens,
            message.round.num_accepted_tokens,
            message.round.num_suffix_draft_tokens,
            message.round.num_suffix_accepted_tokens,
            message.round.num_forced_draft_tokens,
            message.round.num_forced_accepted_tokens,
        )
        if message.HasField("round")
        else None,
    )


class Collector:
    """Folds chunks into a Completion (deduplicating tokens re-sent after a resume)."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text = ""
        self.session_id = ""
        self.finish_reason: str | None = None
        self.stats: dict[str, float] = {}

    def add(self, chunk: Chunk) -> Chunk | None:
        """Returns the chunk trimmed to what is new, or None if it repeats what we have."""
        self.session_id = chunk.session_id
        skip = len(self.token_ids) - chunk.index
        if skip > 0 and not chunk.finish_reason:
            if skip >= len(chunk.token_ids):
                return None
            chunk = Chunk(chunk.session_id, chunk.token_ids[skip:], len(self.token_ids), chunk.text)
        self.token_ids.extend(chunk.token_ids)
        self.text += chunk.text
        if chunk.finish_reason:
            self.finish_reason, self.stats = chunk.finish_reason, chunk.stats
        return chunk

    def completion(self) -> Completion:
        assert self.finish_reason is not None
        return Completion(self.session_id, self.text, self.token_ids, self.finish_reason, self.stats)
