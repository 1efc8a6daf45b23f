"""Target sessions: one KV cache each, under a budget of reserved positions, evicted least recently used.

Every cache read or write happens under the store's one lock: on a GPU the model runs one forward at a
time anyway, and it keeps a KV-feed reader from seeing a half-committed cache. Evicting a session is
safe: the router rebuilds it from its token history (Prefill with root_token) on the next NOT_FOUND.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from specserve.errors import InvalidArgument, NotFound, ResourceExhausted
from specserve.runtime.runner import ModelRunner
from specserve.runtime.target import LocalVerifier


@dataclass
class TargetSession:
    session_id: str
    verifier: LocalVerifier
    capacity: int
    epoch: int
    committed_at: float = field(default_factory=time.time)  # wall clock of the newest commit
    closed: bool = False

    @property
    def committed_length(self) -> int:
        return self.verifier.cache.length


class SessionStore:
    def __init__(
        self,
        runner: ModelRunner,
        max_sessions: int,
        kv_budget_tokens: int,
        on_evict: Callable[[], None] = lambda: None,
    ) -> None:
        self.on_evict = on_evict
        self.runner = runner
        self.max_sessions = max_sessions
        self.kv_budget_tokens = kv_budget_tokens
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)  # notified on every commit, rebuild and release
        self._sessions: OrderedDict[str, TargetSession] = OrderedDict()  # least recently used first
        self._epochs = 0

    @property
    def reserved_positions(self) -> int:
        return sum(s.capacity for s in self._sessions.values())

    def __len__(self) -> int:
        return len(self._sessions)

    def create(self, session_id: str, capacity: int) -> TargetSession:
        """Replaces any session of that id; evicts idle sessions to fit. Caller holds the lock."""
        if not 1 <= capacity <= self.kv_budget_tokens:
            raise InvalidArgument(f"capacity must be in [1, {self.kv_budget_tokens}], got {capacity}")
        self._drop(session_id)
        while self._sessions and (
            len(self._sessions) >= self.max_sessions
            or self.reserved_positions + capacity > self.kv_budget_tokens
        ):
            self._drop(next(iter(self._sessions)))  # least recently used
            self.on_evict()
        if (
            len(self._sessions) >= self.max_sessions
            or self.reserved_positions + capacity > self.kv_budget_tokens
        ):
            raise ResourceExhausted("the target's KV budget is full")
        self._epochs += 1
        session = TargetSession(session_id, LocalVerifier(self.runner, capacity), capacity, self._epochs)
        self._sessions[session_id] = session
        self.changed.notify_all()
        return session

    def get(self, session_id: str) -> TargetSession:
        """Caller holds the lock. Marks the session most recently used."""
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFound(f"target has no session {session_id!r} (never created, released or evicted)")
        self._sessions.move_to_end(session_id)
        return session

    def peek(self, session_id: str) -> TargetSession | None:
        return self._sessions.get(session_id)

    def release(self, session_id: str) -> bool:
        with self.lock:
            existed = self._drop(session_id)
            self.changed.notify_all()
            return existed

    def _drop(self, session_id: str) -> bool:
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        session.closed = True
        session.verifier.release()
        return True

    def clear(self) -> None:
        with self.lock:
            for session_id in list(self._sessions):
                self._drop(session_id)
            self.changed.notify_all()
