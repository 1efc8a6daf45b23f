"""How many sessions share a model right now, as a service sees them.

A session counts while its last request is younger than the horizon: between two rounds it holds no
job on the model thread but still shares the next forwards. A caller may also report a load it knows
better (the router forwards the target's count to the draft service, which a session that skips
drafting under load visits only now and then); the count is the larger of the two.
"""

from __future__ import annotations

import threading
import time

RECENT_SECONDS = 1.0


class RecentSessions:
    def __init__(self, horizon_seconds: float = RECENT_SECONDS) -> None:
        self.horizon_seconds = horizon_seconds
        self._seen: dict[str, tuple[float, int]] = {}  # session -> (last request time, reported load)
        self._lock = threading.Lock()

    def touch(self, session_id: str, reported_load: int = 0) -> None:
        with self._lock:
            self._seen[session_id] = (time.monotonic(), reported_load)

    def count(self) -> int:
        horizon = time.monotonic() - self.horizon_seconds
        with self._lock:
            for session_id in [s for s, (t, _) in self._seen.items() if t < horizon]:
                del self._seen[session_id]
            reported = max((load for _, load in self._seen.values()), default=0)
            return max(len(self._seen), reported)

    def forget(self, session_id: str) -> None:
        with self._lock:
            self._seen.pop(session_id, None)
