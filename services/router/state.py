"""Session state in Redis: everything needed to continue a session from another router.

Keys (both expire `ttl` seconds after the last round):
  specserve:session:<id>         hash: prompt_ids, request (GenerationRequest.to_dict, seed fixed), status,
                                 stats, target, draft, created_unix, owner (each field JSON)
  specserve:session:<id>:tokens  list: generated token ids, appended after every round
Tokens are written before they are streamed, so a resumed session never misses what a client saw.

Redis faults: every call retries connection errors with backoff for `retry_seconds` (a restart, a
failover), then raises Unavailable. A cancelled session leaves a short-lived tombstone (status
"cancelled") rather than nothing, so a record that is simply *gone* can only mean Redis lost it (a
restart without persistence, or the last second before a crash with `appendfsync everysec`); the router
that drives the session then writes it back from what it holds, and the generation goes on unchanged.
Appends carry the length they expect, so a retried append is never applied twice and tokens Redis lost
are written again.

Leases: the router driving a session holds `specserve:session:<id>:lease` (its own random id, expiring
after LEASE_SECONDS, renewed by every append and by a heartbeat through long rounds). A Resume on another
router waits for the lease (a router that died lets it expire within seconds), so two routers never
drive one session at once; a router that finds its lease taken stops with UNAVAILABLE and leaves the
session to the new holder.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis

from specserve.core.request import GenerationRequest
from specserve.errors import InvalidArgument, NotFound, Unavailable

KEY_PREFIX = "specserve:session:"
TOMBSTONE_SECONDS = 120  # how long a cancelled session's id stays known as cancelled
RETRY_BACKOFF_SECONDS = (0.05, 0.1, 0.2, 0.5, 1.0)
MAX_LOCAL_SESSIONS = 10_000  # sessions whose written tokens this router remembers (LRU)
LEASE_SECONDS = 6.0  # a dead router's sessions can be resumed elsewhere after this long
HEARTBEAT_SECONDS = 2.0
MAX_ROUND_SECONDS = 60.0  # a lease nobody appended under for this long is let go (a stuck worker)
T = TypeVar("T")


# KEYS: session hash, token list, lease. ARGV: ttl, running status (JSON), start (the list length the
# caller expects), n, n tokens, router id, lease ms, then field/value pairs. Returns APPENDED, MISSING,
# NOT_RUNNING, LEASED (another router drives it), or the list's actual length when it is not `start`
# (the caller re-sends from there). Renews the caller's lease.
_APPEND_SCRIPT = """
local n = tonumber(ARGV[4])
local holder = redis.call('GET', KEYS[3])
if holder and holder ~= ARGV[5 + n] then return -4 end
if redis.call('EXISTS', KEYS[1]) == 0 then return -2 end
if redis.call('HGET', KEYS[1], 'status') ~= ARGV[2] then return -3 end
redis.call('SET', KEYS[3], ARGV[5 + n], 'PX', ARGV[6 + n])
local length = redis.call('LLEN', KEYS[2])
if length ~= tonumber(ARGV[3]) then return length end
if n > 0 then redis.call('RPUSH', KEYS[2], unpack(ARGV, 5, 4 + n)) end
for i = 7 + n, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('EXPIRE', KEYS[1], ARGV[1])
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('EXPIRE', KEYS[2], ARGV[1]) end
return -1
"""
APPENDED, MISSING, NOT_RUNNING, LEASED = -1, -2, -3, -4

# KEYS: lease. ARGV: router id, lease ms. Takes the lease if it is free or ours; 1 if we hold it now.
_TAKE_LEASE_SCRIPT = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
# KEYS: lease. ARGV: router id. Drops the lease if it is ours.
_DROP_LEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: session hash, token list. ARGV: ttl, cancelled status (JSON), replace (0/1), field/value pairs.
# Creates the record unless a live one exists (a tombstone is replaced; `replace` restores a lost one).
_CREATE_SCRIPT = """
local status = redis.call('HGET', KEYS[1], 'status')
if status and status ~= ARGV[2] and ARGV[3] == '0' then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""


def scoped_session_id(owner: str, session_id: str) -> str:
    """The id a session is stored and run under (its Redis keys, its target and draft sessions), from
    the id its caller named or was given and the caller's principal (serving/auth.py): that id itself
    without auth (one tenant), else a digest of both. Tenants' ids never meet: another tenant's id is a
    key nobody wrote, answered exactly as an unknown one, and Generate with it starts the caller's own
    session."""
    if not owner:
        return session_id
    return hashlib.blake2b(f"{owner}/{session_id}".encode(), digest_size=16).hexdigest()


def unknown_session(session_id: str) -> NotFound:
    """The one answer for an id the caller has no session under, whoever else may use it."""
    return NotFound(f"no session {session_id!r} (finished long ago, cancelled, or never started)")


class SessionStatus:
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"  # a tombstone: no tokens, expires after TOMBSTONE_SECONDS


@dataclass
class SessionRecord:
    session_id: str  # the id it is stored and run under (scoped_session_id)
    prompt_ids: list[int]
    request: GenerationRequest  # validated, its seed fixed (GenerationRequest.with_seed)
    status: str = SessionStatus.RUNNING
    finish_reason: str = ""
    stats: dict = field(default_factory=dict)  # cumulative over every router that ran the session
    target: str = ""
    draft: str = ""
    created_unix: float = field(default_factory=time.time)
    owner: str = ""  # the creator's principal (serving/auth.py); "" when auth is off
    public_id: str = ""  # the id its creator named or was given, which its responses carry; "" = session_id

    def __post_init__(self) -> None:
        self.public_id = self.public_id or self.session_id

    def to_fields(self) -> dict[str, Any]:
        """The Redis hash's fields (each stored as JSON)."""
        return vars(self) | {"request": self.request.to_dict()}

    @classmethod
    def from_fields(cls, values: dict[str, Any]) -> SessionRecord:
        return cls(**(values | {"request": GenerationRequest.from_dict(values["request"])}))


class SessionState:
    def __init__(
        self,
        url: str,
        ttl_seconds: int,
        retry_seconds: float = 15.0,
        ssl_ca_file: str = "",
        ssl_cert_file: str = "",
        ssl_key_file: str = "",
    ) -> None:
        tls: dict[str, Any] = {}
        if url.startswith("rediss://"):
            tls = {
                k: v
                for k, v in [
                    ("ssl_ca_certs", ssl_ca_file),
                    ("ssl_certfile", ssl_cert_file),
                    ("ssl_keyfile", ssl_key_file),
                ]
                if v
            }
        self.redis = redis.Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=5.0, **tls)
        self.ttl = ttl_seconds
        self.retry_seconds = retry_seconds
        self._append = self.redis.register_script(_APPEND_SCRIPT)
        self._create = self.redis.register_script(_CREATE_SCRIPT)
        self._take_lease = self.redis.register_script(_TAKE_LEASE_SCRIPT)
        self._drop_lease = self.redis.register_script(_DROP_LEASE_SCRIPT)
        # What this router wrote for the sessions it drives: enough to write a lost record back.
        self._local: OrderedDict[str, tuple[SessionRecord, list[int]]] = OrderedDict()
        self.router_id = uuid.uuid4().hex  # the lease holder's name
        self._leases: dict[str, float] = {}  # session id -> when we last appended or took it
        self._leases_lock = threading.Lock()
        self._closed = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def _retrying(self, call: Callable[[], T]) -> T:
        """Retries connection errors (Redis restarting, loading its AOF, failing over) for
        retry_seconds with backoff; then, and on any other Redis error, Unavailable."""
        deadline = time.monotonic() + self.retry_seconds
        attempt = 0
        while True:
            try:
                return call()
            except (redis.ConnectionError, redis.TimeoutError) as e:
                if time.monotonic() >= deadline:
                    raise Unavailable(f"redis: {e}") from None
                time.sleep(RETRY_BACKOFF_SECONDS[min(attempt, len(RETRY_BACKOFF_SECONDS) - 1)])
                attempt += 1
            except redis.RedisError as e:
                raise Unavailable(f"redis: {e}") from None

    def ping(self) -> None:
        self._retrying(self.redis.ping)

    @staticmethod
    def key(session_id: str) -> str:
        return KEY_PREFIX + session_id

    def _remember(self, record: SessionRecord, tokens: list[int]) -> None:
        self._local[record.session_id] = (record, tokens)
        self._local.move_to_end(record.session_id)
        while len(self._local) > MAX_LOCAL_SESSIONS:
            self._local.popitem(last=False)

    def _write_record(self, record: SessionRecord, replace: bool) -> bool:
        key = self.key(record.session_id)
        args: list[Any] = [self.ttl, json.dumps(SessionStatus.CANCELLED), int(replace)]
        for name, value in record.to_fields().items():
            args += [name, json.dumps(value)]
        return bool(self._retrying(lambda: self._create(keys=[key, key + ":tokens"], args=args)))

    def create(self, record: SessionRecord) -> None:
        # Atomic: a second Generate with the same id loses (unless the first was cancelled).
        if not self._write_record(record, replace=False):
            raise InvalidArgument(f"session {record.public_id!r} already exists")
        self._remember(record, [])
        self._retrying(lambda: self.redis.delete(self.key(record.session_id) + ":lease"))  # a predecessor's
        self.take_lease(record.session_id, wait_seconds=0.0)

    # -- leases ------------------------------------------------------------------------------------------
    def take_lease(self, session_id: str, wait_seconds: float = LEASE_SECONDS + 1.0) -> None:
        """Before driving a session: waits up to `wait_seconds` for another router's lease to end
        (released, or expired because that router died), then UNAVAILABLE."""
        key = self.key(session_id) + ":lease"
        args: list[str | int] = [self.router_id, int(LEASE_SECONDS * 1000)]
        deadline = time.monotonic() + wait_seconds
        while not self._retrying(lambda: self._take_lease(keys=[key], args=args)):
            if time.monotonic() >= deadline:
                raise Unavailable(f"session {session_id!r} is being generated by another router")
            time.sleep(0.2)
        with self._leases_lock:
            self._leases[session_id] = time.monotonic()
        self._start_heartbeat()

    def release_lease(self, session_id: str) -> None:
        """When this router stops driving the session (finished, failed or cancelled)."""
        with self._leases_lock:
            held = self._leases.pop(session_id, None)
        if held is not None:
            with contextlib.suppress(redis.RedisError):  # else it expires by itself
                self._drop_lease(keys=[self.key(session_id) + ":lease"], args=[self.router_id])

    def _start_heartbeat(self) -> None:
        with self._leases_lock:
            if self._heartbeat is not None:
                return
            self._heartbeat = threading.Thread(target=self._renew_leases, name="session-leases", daemon=True)
            self._heartbeat.start()

    def _renew_leases(self) -> None:
        """Keeps our leases alive through long rounds (a target rebuild, retries)."""
        while not self._closed.wait(HEARTBEAT_SECONDS):
            now = time.monotonic()
            with self._leases_lock:
                stale = [s for s, t in self._leases.items() if now - t > MAX_ROUND_SECONDS]
                for session_id in stale:
                    del self._leases[session_id]
                held = list(self._leases)
            args: list[str | int] = [self.router_id, int(LEASE_SECONDS * 1000)]
            for session_id in held:
                try:
                    if not self._take_lease(keys=[self.key(session_id) + ":lease"], args=args):
                        with self._leases_lock:  # taken over: the next append stops this router
                            self._leases.pop(session_id, None)
                except redis.RedisError:
                    pass  # Redis is restarting: appends retry; the lease is renewed when it is back

    def load(self, session_id: str, public_id: str = "") -> tuple[SessionRecord, list[int]]:
        """The session stored under `session_id`; NotFound (naming `public_id`, the caller's name for it)
        if there is none, or it was cancelled."""

        def read() -> list:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hgetall(self.key(session_id))
            pipe.lrange(self.key(session_id) + ":tokens", 0, -1)
            return pipe.execute()

        raw, tokens = self._retrying(read)
        values = {k.decode(): json.loads(v) for k, v in raw.items()}
        if not raw or values.get("status") == SessionStatus.CANCELLED:
            raise unknown_session(public_id or session_id)
        try:
            record, generated = SessionRecord.from_fields(values), [int(t) for t in tokens]
        except (TypeError, ValueError, KeyError):
            raise NotFound(f"session {public_id or session_id!r} has an unreadable record") from None
        self._remember(record, list(generated))
        return record, generated

    def append(self, session_id: str, token_ids: list[int], **fields: object) -> bool:
        """Appends tokens and updates fields in one atomic round trip, only while the session is running;
        returns False if it was cancelled or finished meanwhile (nothing is written then). A record
        Redis lost is written back first (see the module doc)."""
        key = self.key(session_id)
        known = self._local.get(session_id)
        # None: not created or loaded here (cannot happen in the router): append blindly
        record, written = known if known is not None else (None, [])
        tokens = [*written, *token_ids]
        start = len(written)
        keys = [key, key + ":tokens", key + ":lease"]
        for _ in range(4):
            args: list[Any] = [self.ttl, json.dumps(SessionStatus.RUNNING), start, len(tokens) - start]
            args += [*tokens[start:], self.router_id, int(LEASE_SECONDS * 1000)]
            for name, value in fields.items():
                args += [name, json.dumps(value)]
            result = self._retrying(functools.partial(self._append, keys=keys, args=args))
            if result == APPENDED:
                if record is not None:
                    self._remember(record, tokens)
                with self._leases_lock:
                    if session_id in self._leases:
                        self._leases[session_id] = time.monotonic()
                return True
            if result == NOT_RUNNING:
                return False
            if result == LEASED:
                self._local.pop(session_id, None)
                raise Unavailable(f"session {session_id!r} was resumed on another router")
            if result == MISSING:
                if record is None:
                    return False
                self._write_record(record, replace=True)  # lost by Redis: write it back, then the tokens
                start = 0
            elif 0 <= result <= len(tokens):
                start = int(result)  # Redis lost the last few tokens, or a retried append already landed
            else:
                break
        raise Unavailable(f"redis: the token list of session {session_id!r} does not match this router's")

    def update(self, session_id: str, **fields: object) -> None:
        """Sets fields (the finish) if the session is still running, restoring a lost record first."""
        self.append(session_id, [], **fields)
        self._local.pop(session_id, None)

    def delete(self, session_id: str, tombstone: bool = True) -> bool:
        """Cancels. With `tombstone` (the Cancel RPC) the record stays for TOMBSTONE_SECONDS as
        "cancelled", so the router driving the session, wherever it runs, stops at its next round rather
        than writing it back; that router then deletes it for good (`tombstone=False`), so a cancelled
        session leaves nothing behind. Returns whether there was a live session."""
        key = self.key(session_id)
        self._local.pop(session_id, None)

        def cancel() -> list:
            pipe = self.redis.pipeline(transaction=True)
            pipe.hget(key, "status")
            if tombstone:
                pipe.delete(key + ":tokens")
                pipe.hset(key, "status", json.dumps(SessionStatus.CANCELLED))
                pipe.expire(key, TOMBSTONE_SECONDS)
            else:
                pipe.delete(key, key + ":tokens")
            return pipe.execute()

        status = self._retrying(cancel)[0]
        return status is not None and json.loads(status) != SessionStatus.CANCELLED

    def close(self) -> None:
        self._closed.set()
        for session_id in list(self._leases):
            self.release_lease(session_id)
        self.redis.close()
