"""Target sessions: one KV cache each, under a budget of KV positions, evicted least recently used.

A session's cache grows by need up to its capacity (runtime/kv_cache.py), so the budget counts the
positions sessions actually hold (at least their committed tokens plus one tree), not their capacities.
Commits happen under the store's one lock (the verifier's commit lock), so a KV-feed reader never sees
a half-committed cache; forwards run outside it, batched across sessions on the model thread. Each
session has its own condition on that lock, notified on its commits and when it closes: a commit wakes
only the feed of its own session, not every session's feed. Sessions
with a request in flight are never evicted. Evicting an idle session is safe: the router rebuilds it
from its token history (Prefill with root_token) on the next NOT_FOUND.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from specserve.core.sampling_params import SamplingParams
from specserve.core.suffix_drafter import SuffixDrafter
from specserve.errors import InvalidArgument, NotFound, ResourceExhausted
from specserve.grammar import Guide
from specserve.runtime.prefix_cache import PrefixCache, block_tokens_for
from specserve.runtime.runner import ModelRunner
from specserve.runtime.target import LocalVerifier


@dataclass
class TargetSession:
    session_id: str
    verifier: LocalVerifier
    capacity: int
    epoch: int
    reserve: int  # positions a round may add beyond the committed ones (one tree)
    changed: threading.Condition  # on the store's lock; notified on this session's commits and its close
    committed_at: float = field(default_factory=time.time)  # wall clock of the newest commit
    closed: bool = False
    in_flight: int = 0  # requests running on the model thread; such a session is never evicted
    # Drafts the rounds it runs on its own (core/ahead.py), from this session's tokens only; made on the
    # first Verify that asks for them.
    ahead_drafter: SuffixDrafter | None = None

    @property
    def committed_length(self) -> int:
        return self.verifier.committed_length

    @property
    def footprint(self) -> int:
        """KV positions this session holds or is about to need (what the budget counts)."""
        need = len(self.verifier.token_ids) + self.reserve
        return min(self.capacity, max(self.verifier.cache.allocated, need))


class SessionStore:
    def __init__(
        self,
        runner: ModelRunner,
        max_sessions: int,
        kv_budget_tokens: int,
        on_evict: Callable[[], None] = lambda: None,
        reserve: int = 65,
        prefill_chunk: int = 256,
        prefix_cache_bytes: int = 0,
    ) -> None:
        self.reserve, self.prefill_chunk = reserve, prefill_chunk
        # Prompt K/V across sessions, beside the sessions' budget (a session copies what it reuses).
        block = block_tokens_for(runner, prefill_chunk)
        self.prefix_cache = PrefixCache(prefix_cache_bytes, block) if prefix_cache_bytes else None
        self.on_evict = on_evict
        self.runner = runner
        self.max_sessions = max_sessions
        self.kv_budget_tokens = kv_budget_tokens
        self.lock = threading.RLock()
        self._sessions: OrderedDict[str, TargetSession] = OrderedDict()  # least recently used first
        self._epochs = 0

    @property
    def reserved_positions(self) -> int:
        return sum(s.footprint for s in self._sessions.values())

    @property
    def allocated_positions(self) -> int:
        return sum(s.verifier.cache.allocated for s in self._sessions.values())

    def __len__(self) -> int:
        return len(self._sessions)

    def create(
        self,
        session_id: str,
        capacity: int,
        num_tokens: int,
        sampling: SamplingParams,
        tenant: str = "",
        guide: Guide | None = None,
    ) -> TargetSession:
        """Replaces any session of that id; evicts idle sessions to fit `num_tokens` plus one tree.
        `sampling` and `guide` (its constraint, if any) are the session's: every Verify uses them;
        `tenant` whose cached prefixes it may use.

        Caller holds the lock."""
        if capacity < 1:
            raise InvalidArgument(f"capacity must be >= 1, got {capacity}")
        self._drop(session_id)
        need = min(capacity, num_tokens + self.reserve)
        if need > self.kv_budget_tokens:
            raise InvalidArgument(
                f"{need} KV positions exceed the target's whole budget {self.kv_budget_tokens}"
            )
        self._make_room(need, new_session=True)
        self._epochs += 1
        verifier = LocalVerifier(
            self.runner, capacity, self.lock, self.prefill_chunk, sampling, self.prefix_cache, tenant, guide
        )
        changed = threading.Condition(self.lock)
        session = TargetSession(session_id, verifier, capacity, self._epochs, self.reserve, changed)
        self._sessions[session_id] = session
        return session

    def admit(self, session: TargetSession, end: int) -> None:
        """Makes room for `session` to hold `end` positions, evicting idle sessions. Caller holds the lock."""
        extra = min(session.capacity, end) - session.footprint
        if extra > 0:
            self._make_room(extra, new_session=False)

    def _make_room(self, positions: int, new_session: bool) -> None:
        def full() -> bool:
            too_many = new_session and len(self._sessions) >= self.max_sessions
            return too_many or self.reserved_positions + positions > self.kv_budget_tokens

        for victim in [s for s in self._sessions.values() if s.in_flight == 0]:  # least recently used first
            if not full():
                break
            self._drop(victim.session_id)
            self.on_evict()
        if full():
            raise ResourceExhausted("the target's KV budget is full (every session is busy); retry later")

    def get(self, session_id: str) -> TargetSession:
        """Caller holds the lock. Marks the session most recently used."""
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFound(f"target has no session {session_id!r} (never created, released or evicted)")
        self._sessions.move_to_end(session_id)
        return session

    def peek(self, session_id: str) -> TargetSession | None:
        return self._sessions.get(session_id)

    def release_if_current(self, session: TargetSession) -> None:
        """Releases `session` unless a newer session of its id replaced it."""
        with self.lock:
            if self._sessions.get(session.session_id) is session:
                self._drop(session.session_id)

    def release(self, session_id: str) -> bool:
        with self.lock:
            return self._drop(session_id)

    def _drop(self, session_id: str) -> bool:
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        session.closed = True
        session.verifier.release()
        session.changed.notify_all()  # its feed ends (or, for a rebuild, follows the new session)
        return True

    def clear(self) -> None:
        with self.lock:
            for session_id in list(self._sessions):
                self._drop(session_id)
