"""Bearer tokens on the public router API, checked in one interceptor.

Tokens come from `auth_tokens` (a list) and/or `auth_token_file` (one per line, `#` comments), which is
re-read when it changes, so tokens rotate without a restart. A call without a valid
`authorization: Bearer <token>` gets UNAUTHENTICATED with one fixed message: nothing says whether the
token was unknown, malformed or missing. Health checks stay open (probes carry no token).

A session belongs to its creator: the router stores the creator's `principal` (a hash of the token,
never the token) with the session and keys it by principal and id (services/router/state.py
`scoped_session_id`), so another token's Resume, Cancel or Generate with that id never reaches it: an
id another tenant uses is answered exactly as an unknown one.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc

from specserve.errors import InvalidArgument
from specserve.serving.handlers import Continuation, within

logger = logging.getLogger(__name__)

AUTHORIZATION = "authorization"
BEARER = "bearer "
UNAUTHENTICATED_MESSAGE = "missing or invalid credentials"
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.",)
FILE_CHECK_SECONDS = 1.0  # how often the token file's mtime is looked at, at most


def bearer_token(metadata: Iterable[tuple[str, Any]] | None) -> str:
    """The token of an `authorization: Bearer <token>` entry ("" if there is none)."""
    for key, value in metadata or ():
        if key.lower() == AUTHORIZATION and isinstance(value, str) and value.lower().startswith(BEARER):
            return value[len(BEARER) :].strip()
    return ""


def parse_tokens(text: str) -> tuple[str, ...]:
    """A token file's tokens: one per line; blank lines and `#` comments are skipped."""
    return tuple(s for s in (line.strip() for line in text.splitlines()) if s and not s.startswith("#"))


def token_file_text(tokens: Iterable[str]) -> str:
    """Tokens as a token file holds them, one per line. A token the file could not hold (empty, with
    whitespace, or starting with `#`) is refused rather than silently changed."""
    lines = []
    for token in tokens:
        if not token or token.startswith("#") or any(c.isspace() for c in token):
            raise InvalidArgument("a token must be non-empty, hold no whitespace and not start with '#'")
        lines.append(f"{token}\n")
    return "".join(lines)


def read_token_file(path: Path) -> tuple[str, ...]:
    """The tokens of a file a user names (at least one), or InvalidArgument saying what is wrong."""
    try:
        tokens = parse_tokens(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"cannot read the token file {str(path)!r}: {e}") from None
    if not tokens:
        raise InvalidArgument(f"the token file {str(path)!r} holds no token")
    return tokens


def principal(token: str) -> str:
    """Who a token stands for, as stored with the sessions it creates ("" when auth is off)."""
    return hashlib.sha256(token.encode()).hexdigest()[:32] if token else ""


# The principal of the call being handled, set by TokenAuthInterceptor around the handler (another
# front end, such as an HTTP API, sets it with `as_caller` after checking its own credentials).
_CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("specserve_caller", default="")


def current_caller() -> str:
    """The principal of the call being handled ("" when auth is off)."""
    return _CALLER.get()


@contextmanager
def as_caller(caller: str) -> Iterator[None]:
    token = _CALLER.set(caller)
    try:
        yield
    finally:
        _CALLER.reset(token)


class TokenSet:
    """The accepted tokens: a fixed list plus a file re-read when its mtime or size changes."""

    def __init__(self, tokens: Iterable[str] = (), token_file: str = "") -> None:
        self.fixed = tuple(t for t in tokens if t)
        self.token_file = token_file
        self._from_file: tuple[str, ...] = ()
        self._stamp: tuple[float, int] | None = None
        self._checked = 0.0
        self._lock = threading.Lock()
        if token_file:
            self._reload()

    @property
    def enabled(self) -> bool:
        return bool(self.fixed or self.token_file)

    def _reload(self) -> None:
        try:
            stat = os.stat(self.token_file)
        except OSError:
            logger.error("token file %s is missing: no file token is accepted", self.token_file)
            self._from_file, self._stamp = (), None
            return
        stamp = (stat.st_mtime, stat.st_size)
        if stamp == self._stamp:
            return
        self._from_file = parse_tokens(Path(self.token_file).read_text())
        self._stamp = stamp
        logger.info("loaded %d tokens from %s", len(self._from_file), self.token_file)

    def tokens(self) -> tuple[str, ...]:
        if self.token_file:
            with self._lock:
                now = time.monotonic()
                if now - self._checked >= FILE_CHECK_SECONDS:
                    self._checked = now
                    self._reload()
        return self.fixed + self._from_file

    def accepts(self, token: str) -> bool:
        if not token:
            return False
        # Compare against every token in constant time: no early exit tells how many matched.
        matches = [hmac.compare_digest(token.encode(), t.encode()) for t in self.tokens()]
        return any(matches)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    def __init__(self, tokens: TokenSet) -> None:
        self.tokens = tokens

        def deny(request: Any, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation: Continuation, details: Any) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        token = bearer_token(details.invocation_metadata)
        if not self.tokens.accepts(token):
            return self._deny_stream if handler.unary_stream else self._deny_unary
        caller = principal(token)
        return within(handler, lambda request, context: as_caller(caller))


# The HTTP paths that need no token: the liveness probe's and the playground page (which then asks for one).
OPEN_PATHS = ("/health", "/")


class BearerTokenASGI:
    """The same tokens for an ASGI app (the router's HTTP API, where OpenAI clients send their API key
    as the bearer token): 401 in OpenAI's error shape without a valid one, the caller's principal set
    for the request otherwise (so HTTP sessions are bound to their creator too). `open_paths` (health,
    the playground page) need no token."""

    def __init__(self, app: Any, tokens: TokenSet, open_paths: tuple[str, ...] = OPEN_PATHS) -> None:
        self.app = app
        self.tokens = tokens
        self.open_paths = open_paths

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.tokens.enabled or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        header = next(
            (v.decode("latin-1") for k, v in scope.get("headers", ()) if k.lower() == b"authorization"), ""
        )
        token = bearer_token([(AUTHORIZATION, header)])
        if not self.tokens.accepts(token):
            error = {"message": UNAUTHENTICATED_MESSAGE, "type": "invalid_request_error", "param": None}
            body = json.dumps({"error": error | {"code": "invalid_api_key"}}).encode()
            headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        with as_caller(principal(token)):
            await self.app(scope, receive, send)
