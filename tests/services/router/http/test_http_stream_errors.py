"""A server-sent event stream that fails after its first event ends with an error event, never with a
silent cut: a failure the router reports (a target, draft or Redis gone past its retries) and anything
unexpected alike. Only the death of the router process itself (nothing left to send) cuts a stream."""

from __future__ import annotations

import asyncio
import json

from services.router.http.app import _events
from services.router.http.errors import from_specserve
from specserve.errors import Unavailable


class Output:
    """The chunks a stream sends for its messages (the API's own Output folds real ones)."""

    num_tokens = 0  # what each event's `id:` says the client has

    def start_chunks(self) -> list[dict]:
        return [{"start": True}]

    def add(self, message: str) -> list[dict]:
        return [{"text": message}]

    def end_chunks(self) -> list[dict]:
        return [{"end": True}]


class FailingGeneration:
    """Two messages, then `error` (as Generation.next raises what the session's stream ended with)."""

    session_id = "s"

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.messages = ["second"]

    async def next(self, deadline: float | None) -> str | None:
        if self.messages:
            return self.messages.pop()
        raise self.error


def events(error: BaseException) -> list[str]:
    async def collect() -> list[str]:
        return [event async for event in _events(Output(), FailingGeneration(error), "first", None)]

    return asyncio.run(collect())


def last_error(stream: list[str]) -> dict:
    assert stream[-1].startswith("data: ") and stream[-1].endswith("\n\n")
    assert "data: [DONE]\n\n" not in stream
    return json.loads(stream[-1].removeprefix("data: "))["error"]


def test_a_failure_the_router_reports_ends_the_stream_with_its_error() -> None:
    # A target, draft or Redis that stayed away past its retries reaches the stream as UNAVAILABLE.
    stream = events(from_specserve(Unavailable("redis: Connection refused")))
    assert all(e.endswith("\nid: 0\n\n") for e in stream[:3])
    assert [json.loads(e.removeprefix("data: ").split("\n")[0]) for e in stream[:3]] == [
        {"start": True},
        {"text": "first"},
        {"text": "second"},
    ]
    error = last_error(stream)
    assert (error["type"], error["code"]) == ("service_unavailable_error", "unavailable")
    assert "redis" in error["message"]


def test_an_unexpected_failure_still_ends_the_stream_with_an_error_event() -> None:
    error = last_error(events(RuntimeError("a bug")))
    assert error["type"] == "server_error"
    assert "a bug" not in error["message"]  # its type only: details stay in the router's log
