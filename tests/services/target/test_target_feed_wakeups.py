"""A session's KV feed wakes for its own session's commits and close, not for every other session's.

The store and the feed run in process on a tiny model: the feed generator of one session waits in a
thread while another session commits; each session's condition is what the target servicer notifies
after a request (services/target/servicer.py `_done`).
"""

from __future__ import annotations

import queue
import threading
import time

import pytest
from tiny_llama import tiny_llama

from services.target.feed import POLL_SECONDS, kv_feed
from services.target.sessions import SessionStore
from specserve.core.protocols import DraftTree
from specserve.core.sampling_params import GREEDY
from specserve.runtime.runner import ModelRunner

PROMPT = [3, 17, 5, 9, 41, 2, 33, 8]


class CountingCondition:
    """Wraps a session's condition and counts the times a waiter woke (notified or timed out)."""

    def __init__(self, inner: threading.Condition) -> None:
        self.inner, self.wakeups = inner, 0

    def wait(self, timeout: float | None = None) -> bool:
        notified = self.inner.wait(timeout)
        self.wakeups += 1
        return notified

    def notify_all(self) -> None:
        self.inner.notify_all()


@pytest.fixture
def store() -> SessionStore:
    return SessionStore(ModelRunner(tiny_llama()), max_sessions=4, kv_budget_tokens=1024)


def _open(store: SessionStore, session_id: str):
    with store.lock:
        session = store.create(session_id, 128, len(PROMPT), GREEDY)
    session.verifier.prefill(PROMPT, 0)
    return session


def _start_feed(store: SessionStore, session_id: str, stop: threading.Event) -> queue.Queue:
    chunks: queue.Queue = queue.Queue()

    def run() -> None:
        for chunk in kv_feed(store, session_id, 0, [0], 64, lambda: not stop.is_set()):
            chunks.put((time.perf_counter(), chunk))
        chunks.put((time.perf_counter(), None))  # the feed ended

    threading.Thread(target=run, daemon=True).start()
    return chunks


def test_a_commit_wakes_its_own_feed_only_and_a_release_ends_it(store) -> None:
    a, b = _open(store, "a"), _open(store, "b")
    counted = a.changed = CountingCondition(a.changed)  # type: ignore[assignment]
    stop = threading.Event()
    chunks = _start_feed(store, "a", stop)
    try:
        _, first = chunks.get(timeout=10)
        assert first.start_position == 0 and first.num_positions == len(PROMPT)
        time.sleep(0.05)  # the feed now waits for a's next commit
        before = counted.wakeups
        for _ in range(20):  # other sessions' commits, as the servicer signals them
            with store.lock:
                b.changed.notify_all()
        time.sleep(0.05)
        assert counted.wakeups == before  # none of them woke a's feed (a timeout needs POLL_SECONDS)

        a.verifier.verify(DraftTree.root_only(a.verifier.root_token), 0)  # commits the root
        with store.lock:  # a's own commit: its feed sends it at once, long before a poll would
            committed_at = time.perf_counter()
            a.changed.notify_all()
        sent_at, chunk = chunks.get(timeout=10)
        assert (chunk.start_position, chunk.num_positions) == (len(PROMPT), 1)
        assert sent_at - committed_at < POLL_SECONDS / 2

        released_at = time.perf_counter()
        store.release("a")
        ended_at, end = chunks.get(timeout=10)
        assert end is None and ended_at - released_at < POLL_SECONDS / 2
    finally:
        stop.set()
