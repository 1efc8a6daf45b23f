"""One generation for the HTTP API: a session started and streamed by the router's own `start_session`
and `stream_session` (the path gRPC Generate takes), turned into OpenAI's objects.

The router's stream is a blocking iterator, one message per round; `Generation` runs it on a thread of
its own and hands the messages to the event loop. `cancel()` is what a client disconnect or a deadline
calls: the router then stops the session and frees its draft, target and Redis state.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field

from services.router.http.errors import HttpError, from_specserve, invalid
from services.router.http.schemas import ChatCompletionRequest, CompletionRequest, GenerationFields
from services.router.http.structured import BodyConstraint
from services.router.servicer import OnClientGone, RouterServicer
from services.router.tokenizer import IncrementalText, RouterTokenizer
from specserve.core.constraint import InvalidConstraint
from specserve.core.request import GenerationRequest, InvalidField
from specserve.errors import SpecserveError, quoted
from specserve.v1 import common_pb2, router_pb2

FINISH_REASONS = {  # specserve's finish reason -> OpenAI's
    common_pb2.FINISH_REASON_EOS: "stop",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
}
_END = object()


# GenerationRequest's field names -> the body's, where OpenAI names them otherwise
_PARAMS = {"max_new_tokens": "max_tokens"}


def generation_request(
    body: ChatCompletionRequest | CompletionRequest,
    prompt_ids: list[int],
    servicer: RouterServicer,
    constraint: BodyConstraint | None = None,
) -> GenerationRequest:
    """The validated request of an HTTP body, through the router's GenerationRequest.build (so gRPC and
    HTTP refuse the same input with the same message); sampling defaults are OpenAI's: temperature 1."""
    max_new_tokens = body.max_new_tokens
    if max_new_tokens is None:  # the router's default cap, as for a gRPC request naming no limit
        max_new_tokens = servicer.default_max_new_tokens(len(prompt_ids))
    top = body.num_top_logprobs
    try:
        return GenerationRequest.build(
            method=body.method or servicer.settings.default_method,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            max_new_tokens=max_new_tokens,
            stop=body.stop_strings,
            ignore_eos=body.ignore_eos,
            seed=body.seed,
            allow_lossy=body.allow_lossy,
            logprobs=top is not None,
            top_logprobs=top or 0,
            constraint=None if constraint is None else constraint.constraint,
            limits=servicer.limits,
            prompt_ids=prompt_ids,
        )
    except InvalidField as e:
        raise invalid(str(e), (_PARAMS | {"prompt": body.prompt_param}).get(e.field, e.field)) from None
    except InvalidConstraint as e:
        raise invalid(str(e), None if constraint is None else constraint.param) from None


def constraint_error(error: HttpError, constraint: BodyConstraint | None) -> HttpError:
    """A 400 from the session before its first token, for a constrained request the router accepted and
    compiled, is the constraint's: the target could not compile it either (InvalidConstraint, which
    crosses gRPC as a plain INVALID_ARGUMENT). It names the field the constraint came from."""
    if constraint is None or error.status != 400 or error.param is not None:
        return error
    return HttpError(error.status, error.message, error.type, constraint.param, error.code)


@dataclass(frozen=True)
class RoundText:
    accepted: str  # the text of the draft's tokens the target accepted
    target: str  # the text of the target's own token
    suffix: str = ""  # the part of `accepted` the suffix index proposed (before `forced`)
    forced: str = ""  # the tail of `accepted` a constraint's grammar forced


class TextAssembler:
    """Rounds of tokens -> the text deltas the router's own stream sends (IncrementalText: no stop
    string, nor the start of one, ever shows), each split into the part the draft's accepted tokens
    produced and the target's own part."""

    def __init__(
        self, tokenizer: RouterTokenizer, stops: Sequence[str] = (), received: Sequence[int] = ()
    ) -> None:
        # received: tokens the client has already (a resumed stream continues their text exactly)
        self.incremental = IncrementalText(tokenizer, received, stops)

    def add(self, token_ids: Sequence[int], num_accepted: int, num_suffix: int = 0) -> tuple[str, str, str]:
        """Returns (accepted text, target text, the accepted text's suffix-index tail) of a round:
        accepted + target is the new content; the last `num_suffix` accepted tokens came from the suffix
        index, and the third string is their share of the accepted text."""
        parts = self.add_round(token_ids, num_accepted, num_suffix)
        return parts.accepted, parts.target, parts.suffix

    def add_round(
        self, token_ids: Sequence[int], num_accepted: int, num_suffix: int = 0, num_forced: int = 0
    ) -> RoundText:
        """As `add`, and the accepted text's parts by origin. A round's accepted path is the draft
        model's tokens, then the suffix index's, then what a constraint's grammar forced after them (the
        engine appends forced tokens to the path's end, core/grammar.py): the last `num_forced` accepted
        tokens were forced, the `num_suffix` before them came from the suffix index."""
        incremental = self.incremental
        sent_before = len(incremental.sent)

        def end_after(count: int) -> int:  # where the text of the round's first `count` tokens ends
            return len(incremental.visible([*incremental.token_ids, *token_ids[:count]])) - sent_before

        after_accepted = end_after(num_accepted)
        # decoded again only for rounds that took suffix or forced tokens
        after_suffix = end_after(num_accepted - num_forced) if num_forced else after_accepted
        after_model = end_after(num_accepted - num_forced - num_suffix) if num_suffix else after_suffix
        delta = incremental.add(token_ids)
        boundary = min(max(0, after_accepted), len(delta))
        suffix_end = min(max(0, after_suffix), boundary)
        model_end = min(max(0, after_model), suffix_end)
        return RoundText(
            delta[:boundary], delta[boundary:], delta[model_end:suffix_end], delta[suffix_end:boundary]
        )

    def finish(self) -> str:
        """The rest of the text once the generation ended."""
        incremental = self.incremental
        return incremental.add([], final_text=incremental.visible(incremental.token_ids, final=True))

    @property
    def text(self) -> str:
        return self.incremental.sent


class Generation:
    """A session's stream on a thread of its own, consumed from the event loop. `stream` starts it (on
    that thread: a resumed one may wait for a dead router's lease), given what registers a callback for
    when the client goes away: the router's `stream_session` of a new session, or `resume_session`."""

    def __init__(
        self, session_id: str, stream: Callable[[OnClientGone], Iterator[router_pb2.GenerateResponse]]
    ) -> None:
        self.session_id = session_id
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._lock = threading.Lock()
        self._on_gone: list[Callable[[], None]] = []
        self._gone = False
        # In the request's context: the caller's principal (serving/auth.py) finds the caller's sessions.
        context = contextvars.copy_context()
        threading.Thread(
            target=context.run, args=(self._pump, stream), name="http-generation", daemon=True
        ).start()

    def _register(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._on_gone.append(callback)
            gone = self._gone
        if gone:
            callback()

    def cancel(self) -> None:
        """The client went away or its deadline passed: the router cancels the session."""
        with self._lock:
            self._gone = True
            callbacks = list(self._on_gone)
        for callback in callbacks:
            callback()

    def _pump(self, stream: Callable[[OnClientGone], Iterator[router_pb2.GenerateResponse]]) -> None:
        item: object = _END
        iterator = None
        try:
            iterator = stream(self._register)
            for message in iterator:
                self._put(message)
        except BaseException as e:
            item = e
        finally:
            if isinstance(iterator, Generator):
                iterator.close()
        self._put(item)

    def _put(self, item: object) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop has closed (server shutdown): nobody is listening
            self.cancel()

    async def next(self, deadline: float | None) -> router_pb2.GenerateResponse | None:
        """The next message (None once the stream ended); 504 once `deadline` (event-loop time) passed."""
        try:
            if deadline is None:
                item = await self._queue.get()
            else:
                item = await asyncio.wait_for(self._queue.get(), max(0.0, deadline - self._loop.time()))
        except TimeoutError:
            self.cancel()
            raise HttpError(
                504,
                "the generation did not finish within timeout_seconds",
                "timeout_error",
                "timeout_seconds",
                "deadline_exceeded",
            ) from None
        if item is _END:
            return None
        if isinstance(item, SpecserveError):
            raise from_specserve(item)
        if isinstance(item, BaseException):
            raise item
        if item.finish_reason == common_pb2.FINISH_REASON_CANCELLED:
            raise HttpError(503, "the session was cancelled", "service_unavailable_error", code="cancelled")
        return item


def usage(prompt_tokens: int, stats: router_pb2.GenerationStats, method: str, session_id: str) -> dict:
    """OpenAI's usage object plus specserve's speculative figures under "specserve"."""
    completion = stats.num_generated_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        # as OpenAI reports its prompt caching: prompt tokens the target took from its prefix cache
        "prompt_tokens_details": {"cached_tokens": stats.num_cached_tokens},
        "specserve": {
            "session_id": session_id,
            "method": method,
            # target forwards after the prefill: one verification each, with or without a draft
            "num_rounds": max(0, stats.num_target_forwards - 1),
            "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens,
            # of the two above, the tokens the session's suffix index proposed (no draft model)
            "num_suffix_draft_tokens": stats.num_suffix_draft_tokens,
            "num_suffix_accepted_tokens": stats.num_suffix_accepted_tokens,
            # ... and those a constraint's grammar forced (its only continuation)
            "num_forced_draft_tokens": stats.num_forced_draft_tokens,
            "num_forced_accepted_tokens": stats.num_forced_accepted_tokens,
            # of num_rounds, those the target ran on its own (suffix candidates, no round trip each)
            "num_ahead_rounds": stats.num_ahead_rounds,
            "mean_accepted_length": stats.mean_accepted_length,
            "tokens_per_second": stats.tokens_per_second,
            "elapsed_seconds": stats.elapsed_seconds,
        },
    }


def chat_logprobs(tokenizer: RouterTokenizer, logprobs: Sequence[common_pb2.TokenLogprob]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            entry(lp.token_id, lp.logprob)
            | {"top_logprobs": [entry(t, v) for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)]}
            for lp in logprobs
        ]
    }


def completion_logprobs(
    tokenizer: RouterTokenizer, logprobs: Sequence[common_pb2.TokenLogprob], text_offset: int
) -> dict:
    tokens = [tokenizer.token_text(lp.token_id) for lp in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [
            {tokenizer.token_text(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)}
            for lp in logprobs
        ],
        "text_offset": offsets,
    }


@dataclass
class Round:
    """One round as the HTTP API reports it (the `specserve.round` extension of a stream chunk)."""

    index: int
    token_ids: list[int]
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_text: str
    target_text: str
    num_suffix_accepted_tokens: int = 0  # accepted tokens from the suffix index (before the forced ones)
    suffix_text: str = ""  # their text
    num_forced_accepted_tokens: int = 0  # the last of the accepted tokens, forced by the constraint
    forced_text: str = ""  # their text: the tail of accepted_text
    unix_seconds: float = field(default_factory=time.time)

    def to_json(self) -> dict:
        return {
            "index": self.index,
            "token_ids": self.token_ids,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_suffix_accepted_tokens": self.num_suffix_accepted_tokens,
            "accepted_text": self.accepted_text,
            "suffix_text": self.suffix_text,
            "num_forced_accepted_tokens": self.num_forced_accepted_tokens,
            "forced_text": self.forced_text,
            "target_text": self.target_text,
        }


def check_model(body: GenerationFields, served: str) -> None:
    if body.model not in (None, "", served):
        raise HttpError(
            404,
            f"the model {quoted(body.model)} does not exist; this server serves {served!r}",
            "not_found_error",
            "model",
            "model_not_found",
        )
