"""When the target and the draft release a session nobody drives any more: leases and idle timeouts.

A router that dies leaves its sessions on the target and the draft; without an end they hold KV memory
and slots until LRU eviction. Two clocks per session, each released through the service's own Release:

- the lease (`lease_seconds`, 15 s by default): every call that names the session renews it, and so
  does the router's heartbeat (`SessionLeaseService.Renew`, services/router/leases.py), which covers
  the gaps a live router leaves (a round waiting on Redis or on a restarting target, rounds that need
  no draft). A lapsed lease means the router died: the session goes within seconds;
- the idle timeout (`idle_seconds`, 600 s): only calls count. It catches a router that is alive and
  renewing but no longer drives the session (a stuck run).

A session with a call in flight (a long prefill) is never released. Calls are seen by an interceptor,
so the servicers need not know. A router that resumes a released session later loses nothing: it
rebuilds the target session from the history in Redis and prefills the draft again, as after an
eviction.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc

from specserve.errors import InvalidArgument
from specserve.serving.convert import SESSION_ID
from specserve.serving.handlers import Continuation, within
from specserve.v1 import lease_pb2, lease_pb2_grpc

logger = logging.getLogger(__name__)

# Calls that do not count as activity: Release ends the session (it is forgotten); a KV feed stays
# open as long as the draft mirrors the session, which says nothing about whether a router drives it.
RELEASE_METHOD = "/Release"
PASSIVE_METHODS = (RELEASE_METHOD, "/StreamKV")
MAX_RENEWED_IDS = 10_000  # per Renew call: bounds the work one request can ask for
LEASE_SERVICE_NAME = lease_pb2.DESCRIPTOR.services_by_name["SessionLeaseService"].full_name


@dataclass
class _Session:
    last_call: float  # the idle clock
    last_renewed: float  # the lease clock: calls and renewals
    in_flight: int = 0


class SessionExpiry:
    """Per session id, the two clocks of the module doc; `reap()` releases the sessions past either."""

    def __init__(
        self,
        idle_seconds: float,
        release: Callable[[str], object],
        clock: Callable[[], float] = time.monotonic,
        lease_seconds: float = 0.0,  # 0 = no lease
    ) -> None:
        self.idle_seconds, self.lease_seconds = idle_seconds, lease_seconds
        self.release = release
        self.clock = clock
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.idle_seconds > 0 or self.lease_seconds > 0

    def touch(self, session_id: str) -> None:
        """A call named the session: both clocks start over."""
        now = self.clock()
        with self._lock:
            session = self._sessions.setdefault(session_id, _Session(now, now))
            session.last_call = session.last_renewed = now

    @contextmanager
    def calling(self, session_id: str) -> Iterator[None]:
        """Around a call: the session is touched as it starts and ends, and never released meanwhile."""
        self.touch(session_id)
        with self._lock:
            self._sessions[session_id].in_flight += 1
        try:
            yield
        finally:
            self.touch(session_id)
            with self._lock:
                self._sessions[session_id].in_flight -= 1

    def renew(self, session_ids: Iterable[str]) -> None:
        """The router still drives these sessions. Ids no call named yet (or released) are ignored."""
        now = self.clock()
        with self._lock:
            for session_id in session_ids:
                session = self._sessions.get(session_id)
                if session is not None:
                    session.last_renewed = now

    def forget(self, session_id: str) -> None:
        """Released by its router: nothing left to expire."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is not None and session.in_flight == 0:
                del self._sessions[session_id]

    def _expired(self, session: _Session, now: float) -> str:
        """Why the session is to be released ("" = it is not)."""
        if session.in_flight:
            return ""
        if self.lease_seconds > 0 and now - session.last_renewed > self.lease_seconds:
            return f"its lease lapsed (no call nor renewal for {self.lease_seconds:.0f} s)"
        if self.idle_seconds > 0 and now - session.last_call > self.idle_seconds:
            return f"idle for more than {self.idle_seconds:.0f} s"
        return ""

    def reap(self) -> list[str]:
        """Releases every session past its lease or idle timeout; returns their ids."""
        now = self.clock()
        with self._lock:
            reasons = {
                session_id: self._expired(session, now) for session_id, session in self._sessions.items()
            }
            expired = {session_id: why for session_id, why in reasons.items() if why}
            for session_id in expired:
                del self._sessions[session_id]
        for session_id, why in expired.items():
            try:
                released = self.release(session_id)  # the service's ReleaseResponse
                if getattr(released, "released", True):
                    logger.info("released session %s: %s", session_id, why)
            except Exception:
                logger.warning("releasing expired session %s failed", session_id, exc_info=True)
        return list(expired)

    def start(self) -> SessionExpiry:
        """The reaper thread: looks often enough that a session goes at most a quarter late."""
        timeouts = [t for t in (self.idle_seconds, self.lease_seconds) if t > 0]
        if not timeouts:
            return self
        interval = min(max(min(timeouts) / 4, 0.05), 10.0)

        def run() -> None:
            while not self._stop.wait(interval):
                self.reap()

        self._thread = threading.Thread(target=run, name="session-expiry", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


class ActivityInterceptor(grpc.ServerInterceptor):
    """Every call naming a session (see PASSIVE_METHODS) counts as activity for the whole of its run;
    a Release makes `sessions` forget the session."""

    def __init__(self, sessions: SessionExpiry) -> None:
        self.sessions = sessions

    def intercept_service(self, continuation: Continuation, details: Any) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None:
            return handler
        if details.method.endswith(RELEASE_METHOD):
            return within(handler, lambda request, _: self._released(request))
        if details.method.endswith(PASSIVE_METHODS):
            return handler
        return within(handler, lambda request, _: self._calling(request))

    @staticmethod
    def _session_id(request: Any) -> str:
        session_id = getattr(request, "session_id", "")
        return session_id if isinstance(session_id, str) and SESSION_ID.fullmatch(session_id) else ""

    @contextmanager
    def _calling(self, request: Any) -> Iterator[None]:
        session_id = self._session_id(request)
        if not session_id:
            yield
            return
        with self.sessions.calling(session_id):
            yield

    @contextmanager
    def _released(self, request: Any) -> Iterator[None]:
        yield
        if session_id := self._session_id(request):
            self.sessions.forget(session_id)


class SessionLeaseServicer(lease_pb2_grpc.SessionLeaseServiceServicer):
    """`SessionLeaseService` on the target and the draft: the router's heartbeat renews its sessions."""

    def __init__(self, sessions: SessionExpiry) -> None:
        self.sessions = sessions

    def Renew(
        self, request: lease_pb2.RenewLeasesRequest, context: grpc.ServicerContext
    ) -> lease_pb2.RenewLeasesResponse:
        if len(request.session_ids) > MAX_RENEWED_IDS:
            raise InvalidArgument(f"at most {MAX_RENEWED_IDS} session ids per call")
        self.sessions.renew(s for s in request.session_ids if SESSION_ID.fullmatch(s))
        return lease_pb2.RenewLeasesResponse(lease_seconds=self.sessions.lease_seconds)
