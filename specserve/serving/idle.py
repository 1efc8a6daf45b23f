"""Idle timeouts for the target's and the draft's sessions.

A router that dies (or a client that never resumes) leaves its sessions on the target and the draft;
without a timeout they hold KV memory until LRU eviction. Every RPC that carries a `session_id` marks
the session active (an interceptor, so the servicers need not know); a reaper thread releases, through
the service's own Release, each session no RPC has touched for `idle_seconds`. A router that comes
back later loses nothing: it rebuilds the target session from the history in Redis and re-prefills
the draft, as after an eviction.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from specserve.serving.convert import SESSION_ID
from specserve.serving.handlers import Continuation, around_calls

logger = logging.getLogger(__name__)

# Calls that do not count as activity: Release ends the session; a KV feed stays open as long as the
# draft mirrors the session, which says nothing about whether a router still drives it.
PASSIVE_METHODS = ("/Release", "/StreamKV")


class IdleSessions:
    """Last activity per session id; `reap()` releases those idle for longer than `idle_seconds`."""

    def __init__(
        self,
        idle_seconds: float,
        release: Callable[[str], object],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.idle_seconds = idle_seconds
        self.release = release
        self.clock = clock
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def touch(self, session_id: str) -> None:
        with self._lock:
            self._last[session_id] = self.clock()

    def forget(self, session_id: str) -> None:
        with self._lock:
            self._last.pop(session_id, None)

    def reap(self) -> list[str]:
        """Releases every session idle for too long; returns their ids."""
        now = self.clock()
        with self._lock:
            idle = [s for s, last in self._last.items() if now - last > self.idle_seconds]
            for session_id in idle:
                del self._last[session_id]
        for session_id in idle:
            try:
                self.release(session_id)
                logger.info("released session %s: idle for more than %.0f s", session_id, self.idle_seconds)
            except Exception:
                logger.warning("releasing idle session %s failed", session_id, exc_info=True)
        return idle

    def start(self) -> IdleSessions:
        interval = min(max(self.idle_seconds / 4, 0.05), 10.0)

        def run() -> None:
            while not self._stop.wait(interval):
                self.reap()

        self._thread = threading.Thread(target=run, name="idle-sessions", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


class ActivityInterceptor(grpc.ServerInterceptor):
    """Marks the session of every active call (see PASSIVE_METHODS) in `sessions`."""

    def __init__(self, sessions: IdleSessions) -> None:
        self.sessions = sessions

    def intercept_service(self, continuation: Continuation, details: Any) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or details.method.endswith(PASSIVE_METHODS):
            return handler
        # a long call (a prefill) counts as activity until it ends
        return around_calls(
            handler, lambda request, _: self._note(request), lambda request, _: self._note(request)
        )

    def _note(self, request: Any) -> None:
        session_id = getattr(request, "session_id", "")
        if isinstance(session_id, str) and SESSION_ID.fullmatch(session_id):
            self.sessions.touch(session_id)
