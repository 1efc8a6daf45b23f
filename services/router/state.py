"""Session state in Redis: everything needed to continue a session from another router.

Keys (both expire `ttl` seconds after the last round):
  specserve:session:<id>         hash: prompt_ids, params, method, seed, status, stats, target, draft
  specserve:session:<id>:tokens  list: generated token ids, appended after every round
Tokens are written before they are streamed, so a resumed session never misses what a client saw.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import redis

from specserve.errors import InvalidArgument, NotFound, Unavailable

KEY_PREFIX = "specserve:session:"


# KEYS: session hash, token list. ARGV: ttl, running status (JSON), n, n tokens, then field/value pairs.
_APPEND_SCRIPT = """
if redis.call('HGET', KEYS[1], 'status') ~= ARGV[2] then return 0 end
local n = tonumber(ARGV[3])
if n > 0 then redis.call('RPUSH', KEYS[2], unpack(ARGV, 4, 3 + n)) end
for i = 4 + n, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('EXPIRE', KEYS[1], ARGV[1])
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('EXPIRE', KEYS[2], ARGV[1]) end
return 1
"""


class SessionStatus:
    RUNNING = "running"
    FINISHED = "finished"  # Cancel deletes the state instead: a cancelled session is simply gone


@dataclass
class SessionRecord:
    session_id: str
    prompt_ids: list[int]
    params: dict  # SamplingParams fields, seed resolved
    method: str
    seed: int
    status: str = SessionStatus.RUNNING
    finish_reason: str = ""
    stats: dict = field(default_factory=dict)  # cumulative over every router that ran the session
    target: str = ""
    draft: str = ""
    created_unix: float = field(default_factory=time.time)


class SessionState:
    def __init__(self, url: str, ttl_seconds: int) -> None:
        self.redis = redis.Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=5.0)
        self.ttl = ttl_seconds
        self._append = self.redis.register_script(_APPEND_SCRIPT)

    def ping(self) -> None:
        try:
            self.redis.ping()
        except redis.RedisError as e:
            raise Unavailable(f"redis: {e}") from None

    @staticmethod
    def key(session_id: str) -> str:
        return KEY_PREFIX + session_id

    def create(self, record: SessionRecord) -> None:
        fields = {k: json.dumps(v) for k, v in asdict(record).items()}
        key = self.key(record.session_id)
        try:
            # HSETNX on session_id makes creation atomic: a second Generate with the same id loses.
            if not self.redis.hsetnx(key, "session_id", fields.pop("session_id")):
                raise InvalidArgument(f"session {record.session_id!r} already exists")
            pipe = self.redis.pipeline(transaction=False)
            pipe.hset(key, mapping=fields)
            pipe.expire(key, self.ttl)
            pipe.execute()
        except redis.RedisError as e:
            raise Unavailable(f"redis: {e}") from None

    def load(self, session_id: str) -> tuple[SessionRecord, list[int]]:
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hgetall(self.key(session_id))
            pipe.lrange(self.key(session_id) + ":tokens", 0, -1)
            raw, tokens = pipe.execute()
        except redis.RedisError as e:
            raise Unavailable(f"redis: {e}") from None
        if not raw:
            raise NotFound(f"no session {session_id!r} (finished long ago, cancelled, or never started)")
        values = {k.decode(): json.loads(v) for k, v in raw.items()}
        return SessionRecord(**values), [int(t) for t in tokens]

    def append(self, session_id: str, token_ids: list[int], **fields: object) -> bool:
        """Appends tokens and updates fields in one atomic round trip, only while the session is running;
        returns False if it was cancelled, finished or expired meanwhile (nothing is written then)."""
        key = self.key(session_id)
        args = [self.ttl, json.dumps(SessionStatus.RUNNING), len(token_ids), *token_ids]
        for name, value in fields.items():
            args += [name, json.dumps(value)]
        try:
            return bool(self._append(keys=[key, key + ":tokens"], args=args))
        except redis.RedisError as e:
            raise Unavailable(f"redis: {e}") from None

    def update(self, session_id: str, **fields: object) -> None:
        try:
            self.redis.hset(self.key(session_id), mapping={k: json.dumps(v) for k, v in fields.items()})
        except redis.RedisError as e:
            raise Unavailable(f"redis: {e}") from None

    def delete(self, session_id: str) -> bool:
        try:
            return bool(self.redis.delete(self.key(session_id), self.key(session_id) + ":tokens"))
        except redis.RedisError as e:
            raise Unavailable(f"redis: {e}") from None

    def close(self) -> None:
        self.redis.close()
