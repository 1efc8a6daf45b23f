"""Draft sessions: the committed tokens as the draft knows them, a drafter, and the KV mirror feeding it."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from services.draft.mirror import FeedSubscriber, KVMirror
from specserve.core.protocols import Drafter
from specserve.errors import NotFound


@dataclass
class DraftSession:
    session_id: str
    method: str
    token_ids: list[int]
    drafter: Drafter
    mirror: KVMirror
    subscriber: FeedSubscriber

    def close(self) -> None:
        self.subscriber.close()
        self.drafter.release()


class DraftSessionStore:
    """At most `max_sessions`; a new session evicts the least recently used (its router re-prefills)."""

    def __init__(self, max_sessions: int, on_evict: Callable[[], None] = lambda: None) -> None:
        self.max_sessions = max_sessions
        self.on_evict = on_evict
        self.lock = threading.Lock()
        self._sessions: OrderedDict[str, DraftSession] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def put(self, session: DraftSession) -> None:
        with self.lock:
            old = self._sessions.pop(session.session_id, None)
            evicted = []
            while len(self._sessions) >= self.max_sessions:
                evicted.append(self._sessions.popitem(last=False)[1])
            self._sessions[session.session_id] = session
        for s in [*([old] if old else []), *evicted]:
            s.close()
        for _ in evicted:
            self.on_evict()

    def get(self, session_id: str) -> DraftSession:
        with self.lock:
            session = self._sessions.get(session_id)
            if session is None:
                raise NotFound(f"draft has no session {session_id!r} (never created, released or evicted)")
            self._sessions.move_to_end(session_id)
            return session

    def release(self, session_id: str) -> bool:
        with self.lock:
            session = self._sessions.pop(session_id, None)
        if session is not None:
            session.close()
        return session is not None

    def clear(self) -> None:
        with self.lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
        for s in sessions:
            s.close()
