"""The SDK's default retries outlast a router restart: a stream whose router is killed and comes back
seconds later (as `specserve stack` restarts it) goes on where it stopped, with the exact tokens and
text; with no router coming back, the retry budget ends in Unavailable.

The router here is counting_router.py, a process with no model: its tokens are 0, 1, 2, ... so any
token lost or repeated across the restart shows.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from counting_router import token_text

from specserve.client import AsyncClient, Client
from specserve.client.common import RetryBudget
from specserve.errors import Unavailable
from specserve.serving.stack import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]  # starts router processes it kills

ROUTER = Path(__file__).with_name("counting_router.py")
NUM_TOKENS = 40
KILL_AFTER = 5  # tokens received before the router is killed
# About what a supervised router takes to return: `specserve stack` waits 1 s, the router serves
# 2-3.5 s after that.
DOWN_SECONDS = 5.0


class RouterProcess:
    def __init__(self, port: int) -> None:
        self.port = port
        self.process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(ROUTER), str(self.port)], stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None
        assert self.process.stdout.readline().strip() == "serving"

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def restart_later(self, seconds: float) -> threading.Thread:
        def restart() -> None:
            time.sleep(seconds)
            self.start()

        thread = threading.Thread(target=restart, daemon=True)
        thread.start()
        return thread


@pytest.fixture
def router() -> Iterator[RouterProcess]:
    running = RouterProcess(free_port())
    running.start()
    yield running
    if running.process is not None and running.process.poll() is None:
        running.kill()


def expected_text() -> str:
    return "".join(token_text(i) for i in range(NUM_TOKENS))


def test_a_router_killed_mid_stream_is_resumed_by_the_default_client(router) -> None:
    tokens, text, restarter = [], "", None
    start = time.monotonic()
    with Client(router.address) as client:
        for chunk in client.stream("count", max_new_tokens=NUM_TOKENS, session_id=f"s-{NUM_TOKENS}"):
            tokens += chunk.token_ids
            text += chunk.text
            if restarter is None and len(tokens) == KILL_AFTER:
                router.kill()
                restarter = router.restart_later(DOWN_SECONDS)
            last = chunk
    assert tokens == list(range(NUM_TOKENS))
    assert text == expected_text()
    assert last.finish_reason == "length"
    assert time.monotonic() - start >= DOWN_SECONDS  # it really waited the restart out


def test_the_asyncio_client_resumes_the_same_way(router) -> None:
    async def stream() -> tuple[list[int], str]:
        tokens, text, restarter = [], "", None
        async with AsyncClient(router.address) as client:
            async for chunk in client.stream(
                "count", max_new_tokens=NUM_TOKENS, session_id=f"a-{NUM_TOKENS}"
            ):
                tokens += chunk.token_ids
                text += chunk.text
                if restarter is None and len(tokens) == KILL_AFTER:
                    router.kill()
                    restarter = router.restart_later(DOWN_SECONDS)
        return tokens, text

    tokens, text = asyncio.run(stream())
    assert tokens == list(range(NUM_TOKENS))
    assert text == expected_text()


def test_with_no_router_coming_back_the_budget_ends_in_unavailable(router) -> None:
    tokens: list[int] = []
    killed_at = 0.0
    with Client(router.address, retry_seconds=2.0) as client, pytest.raises(Unavailable):
        for chunk in client.stream("count", max_new_tokens=NUM_TOKENS, session_id=f"u-{NUM_TOKENS}"):
            tokens += chunk.token_ids
            if len(tokens) == KILL_AFTER:
                router.kill()
                killed_at = time.monotonic()
    assert 2.0 <= time.monotonic() - killed_at <= 5.0
    assert tokens == list(range(KILL_AFTER))


def test_the_budget_counts_from_the_last_message_and_stops_at_the_deadline() -> None:
    budget = RetryBudget(seconds=0.5)
    assert budget.delay(unavailable=False, deadline=None) is None  # only UNAVAILABLE is retried
    start = time.monotonic()
    while (delay := budget.delay(unavailable=True, deadline=None)) is not None:
        time.sleep(delay)
    assert 0.5 <= time.monotonic() - start <= 0.8  # the last attempt as the budget ends
    budget.received()  # a message: a later outage gets the whole budget again
    assert budget.delay(unavailable=True, deadline=None) is not None
    assert RetryBudget(seconds=30).delay(unavailable=True, deadline=time.monotonic() + 0.01) is None
    assert RetryBudget(seconds=30, max_retries=0).delay(unavailable=True, deadline=None) is None
