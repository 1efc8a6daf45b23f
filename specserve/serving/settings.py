"""One settings object per service, loaded once from SPECSERVE_<ROLE>_* variables (Helm values map onto
them one to one). Torch-free: the router imports this.

Model settings (model dir, device, dtype, bounds) are the engine's own `EngineSettings`
(SPECSERVE_* without a role), shared by the target and draft services.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from specserve.catalog import DEFAULT_METHOD
from specserve.config import load_settings
from specserve.core.prompt_indexes import PROMPT_INDEX_TOKENS
from specserve.core.protocols import MAX_AHEAD_ROUNDS
from specserve.errors import InvalidArgument

S = TypeVar("S", bound="ServerSettings")


@dataclass(frozen=True)
class ServerSettings:
    """What every gRPC service shares. Subclasses set ENV_PREFIX and add their own fields."""

    ENV_PREFIX = "SPECSERVE_SERVER_"

    host: str = "0.0.0.0"
    port: int = 0
    metrics_port: int = 0  # Prometheus /metrics (serving/metrics.py); 0 = off
    # Where /metrics listens. "" = the service's host when TLS with a CA guards it (HTTPS, scrapers
    # show a certificate the CA signed), else loopback: without a CA, anyone who reached the port could
    # read it. Set it (e.g. 0.0.0.0) to open it wider; without TLS that is logged as a warning.
    metrics_host: str = ""
    max_concurrent_rpcs: int = 64  # beyond this, new RPCs get RESOURCE_EXHAUSTED (no unbounded queue)
    max_message_bytes: int = 16 * 1024 * 1024  # both directions
    drain_seconds: float = 20.0  # SIGTERM: stop accepting, let running RPCs finish for this long
    worker_threads: int = 0  # 0 = max_concurrent_rpcs + 8 (server-streaming RPCs hold a thread)
    reflection: bool = True  # grpc.reflection: lets grpcurl and friends list the API; off hides it
    # TLS (serving/tls.py): this service's certificate and key, served to callers and presented to the
    # services it calls, and the CA that signs its peers. Empty = plaintext (warned about off loopback).
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""
    tls_client_auth: bool = True  # with a CA: callers must present a certificate it signed (mutual TLS)
    # A second, plaintext port serving grpc.health.v1 alone: for probes that cannot speak TLS (the
    # kubelet's). It tells only whether the service is SERVING. 0 = off.
    health_port: int = 0

    @classmethod
    def from_env(cls: type[S], environ: Mapping[str, str] | None = None, **overrides: Any) -> S:
        """Defaults, then <ENV_PREFIX><FIELD> variables, then explicit overrides (None = keep)."""
        return load_settings(cls, cls.ENV_PREFIX, environ, overrides).validate()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def num_worker_threads(self) -> int:
        return self.worker_threads or self.max_concurrent_rpcs + 8

    def validate(self: S) -> S:
        for name in ("port", "metrics_port", "health_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise InvalidArgument(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        if self.max_concurrent_rpcs < 1:
            raise InvalidArgument("max_concurrent_rpcs must be >= 1")
        if self.max_message_bytes < 1024:
            raise InvalidArgument("max_message_bytes must be >= 1024")
        if self.drain_seconds < 0:
            raise InvalidArgument("drain_seconds must be >= 0")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise InvalidArgument("tls_cert_file and tls_key_file go together")
        if self.tls_ca_file and not self.tls_cert_file:
            raise InvalidArgument("tls_ca_file needs tls_cert_file and tls_key_file")
        return self


# The router renews leases every third of a lease and at least every 2 s (services/router/leases.py): a
# shorter lease would leave too little room for a renewal that is late.
MIN_LEASE_SECONDS = 3.0


def _check_expiry(lease_seconds: float, idle_seconds: float) -> None:
    if lease_seconds != 0 and not lease_seconds >= MIN_LEASE_SECONDS:
        raise InvalidArgument(f"session_lease_seconds must be 0 (off) or >= {MIN_LEASE_SECONDS:.0f}")
    if idle_seconds < 0:
        raise InvalidArgument("session_idle_seconds must be >= 0")


@dataclass(frozen=True)
class TargetServiceSettings(ServerSettings):
    """The target service: sessions' KV caches under a budget, verification, the KV feed."""

    ENV_PREFIX = "SPECSERVE_TARGET_"

    port: int = 50051
    metrics_port: int = 9101
    # Every session holds one KV-feed stream beside its Prefill/Verify calls: room for 128 sessions.
    max_concurrent_rpcs: int = 256
    max_sessions: int = 128
    # KV positions all sessions may hold together (each holds what it uses, up to its capacity). A new
    # or growing session evicts the least recently used idle sessions to fit; their routers rebuild them
    # from the token history on the next call.
    kv_budget_tokens: int = 131072
    feed_chunk_positions: int = 256  # KV feed: positions per streamed chunk (bounds message size)
    # Continuous batching (runtime/batching.py): tokens one forward may carry, prompt tokens per prefill
    # chunk, requests admitted before RESOURCE_EXHAUSTED, and how long a forward may wait for sessions
    # that verified within the last second and have not sent their next request yet (their answers are
    # on their way through the router; the wait ends once they are all in). Through the stack at 16
    # sessions, 20 ms gave 112 tok/s against 91 with 5 ms (docs/benchmarks.md). 0 = start every forward
    # at once.
    max_tokens_per_forward: int = 1024
    prefill_chunk_tokens: int = 256
    # Bytes of prompt K/V (and hidden-state features) kept across requests, per tenant, in blocks of one
    # prefill chunk (runtime/prefix_cache.py); a prefill starts from its longest cached prefix. Beside
    # kv_budget_tokens, not inside it: the sessions' budget is unchanged. 0 = off.
    prefix_cache_bytes: int = 512 * 1024 * 1024
    max_queued_requests: int = 256
    batch_wait_ms: float = 20.0
    # Session expiry (serving/expiry.py), each 0 = never. A session whose lease lapsed (no call and no
    # renewal from its router's heartbeat for this long: the router died) is released; so is one no
    # Prefill or Verify touched for session_idle_seconds (a router that holds it but no longer drives
    # it). A router that resumes it later rebuilds it from the history in Redis.
    session_lease_seconds: float = 15.0
    session_idle_seconds: float = 600.0
    # With mutual TLS, the certificate common names allowed to call (serving/tls.py): the router for
    # everything but the KV feed, which only the draft may read (it carries every session's KV).
    tls_allowed_clients: tuple[str, ...] = ("specserve-router",)
    tls_kv_feed_clients: tuple[str, ...] = ("specserve-draft",)

    def validate(self) -> TargetServiceSettings:
        super().validate()
        if self.max_sessions < 1 or self.kv_budget_tokens < 1 or self.feed_chunk_positions < 1:
            raise InvalidArgument("max_sessions, kv_budget_tokens and feed_chunk_positions must be >= 1")
        if min(self.max_tokens_per_forward, self.prefill_chunk_tokens, self.max_queued_requests) < 1:
            raise InvalidArgument(
                "max_tokens_per_forward, prefill_chunk_tokens, max_queued_requests must be >= 1"
            )
        if self.batch_wait_ms < 0:
            raise InvalidArgument("batch_wait_ms must be >= 0")
        if self.prefix_cache_bytes < 0:
            raise InvalidArgument("prefix_cache_bytes must be >= 0 (0 = off)")
        _check_expiry(self.session_lease_seconds, self.session_idle_seconds)
        return self


@dataclass(frozen=True)
class DraftServiceSettings(ServerSettings):
    """The draft service: mirrors the target's KV feed per session, proposes trees."""

    ENV_PREFIX = "SPECSERVE_DRAFT_"

    port: int = 50052
    metrics_port: int = 9102
    max_concurrent_rpcs: int = 256
    max_sessions: int = 128
    kv_wait_seconds: float = 2.0  # how long a propose waits for the KV version it needs
    # Build each round's tree when the KV feed delivers the commit, before the router asks
    # (services/draft/servicer.py). Off by default: where the draft shares CPU cores with the router (as
    # measured on 2 cores, docs/benchmarks.md, the distributed stack) the early build competes with the
    # router's own work and gained nothing. Turn it on when the draft has its own GPU or cores.
    prepare_ahead: bool = False
    # Bytes of mirrored prompt K/V (and hidden states) kept across sessions (services/draft/prefix.py): a
    # session whose prompt starts with cached blocks of its tenant and target is fed only what follows
    # them. Only the K/V layers the drafts read: ~1.5 KiB a position for a GliDe draft of the default
    # model in float32, so 128 MiB hold ~80,000 positions. 0 = off.
    prefix_cache_bytes: int = 128 * 1024 * 1024
    # The only targets the draft subscribes to (host:port, as the router names them): a Prefill or
    # Propose naming any other address is refused, so a caller cannot make the draft dial out.
    target_addresses: tuple[str, ...] = ("localhost:50051",)  # env: comma-separated host:port
    # As the target's: released when its lease lapsed (its router died) or idle (no call) for so long.
    session_lease_seconds: float = 15.0
    session_idle_seconds: float = 600.0
    tls_allowed_clients: tuple[str, ...] = ("specserve-router",)  # with mutual TLS: who may call
    tls_target_name: str = ""  # the name on the targets' certificates ("" = the address's host)

    def validate(self) -> DraftServiceSettings:
        super().validate()
        if self.max_sessions < 1 or self.kv_wait_seconds <= 0:
            raise InvalidArgument("max_sessions must be >= 1 and kv_wait_seconds > 0")
        if self.prefix_cache_bytes < 0:
            raise InvalidArgument("prefix_cache_bytes must be >= 0 (0 = off)")
        if not self.target_addresses:
            raise InvalidArgument("target_addresses must name at least one target service")
        _check_expiry(self.session_lease_seconds, self.session_idle_seconds)
        return self


@dataclass(frozen=True)
class RouterServiceSettings(ServerSettings):
    """The public router: drives rounds, keeps sessions in Redis, places them on replicas."""

    ENV_PREFIX = "SPECSERVE_ROUTER_"

    port: int = 50050
    metrics_port: int = 9100
    max_concurrent_rpcs: int = 128
    target_addresses: tuple[str, ...] = ("localhost:50051",)  # env: comma-separated host:port
    draft_addresses: tuple[str, ...] = ("localhost:50052",)
    redis_url: str = "redis://localhost:6379/0"
    session_ttl_seconds: int = 3600  # a session's Redis state expires this long after its last round
    default_method: str = DEFAULT_METHOD
    # New tokens for a request that names no limit (gRPC max_new_tokens 0, HTTP without max_tokens), within
    # the server's limit and what the context leaves: without it such a request runs to the context's end.
    default_max_tokens: int = 1024
    draft_timeout_seconds: float = 5.0  # per propose call; on failure the round verifies the root only
    target_timeout_seconds: float = 30.0  # per prefill / verify call
    # The OpenAI-compatible HTTP API and the playground page (services/router/http); 0 = off.
    http_port: int = 0
    http_max_body_bytes: int = 1024 * 1024  # larger request bodies get 413
    # Public clients authenticate with bearer tokens (serving/auth.py), not certificates.
    tls_client_auth: bool = False
    # The names on the targets' and drafts' certificates when they are dialled by pod IP ("" = the
    # address's host, e.g. localhost); the chart sets their Services' DNS names.
    tls_target_name: str = ""
    tls_draft_name: str = ""
    auth_tokens: tuple[str, ...] = ()  # accepted bearer tokens; prefer auth_token_file (not in env)
    auth_token_file: str = ""  # one token per line, re-read when it changes (rotation without restart)
    # Redis over TLS (a rediss:// redis_url): the CA that signs Redis's certificate and, if Redis asks
    # for one, the router's client certificate and key. The password goes in the URL
    # (redis://:PASSWORD@host:6379/0) or a user and password for an ACL user (redis://USER:PASSWORD@...).
    redis_ca_file: str = ""
    redis_cert_file: str = ""
    redis_key_file: str = ""
    # How long a round keeps retrying Redis (a restart, a failover) before the client gets UNAVAILABLE.
    redis_retry_seconds: float = 15.0
    # Suffix drafting (core/suffix_drafter.py) may also draft from a tenant's recent outputs: kept per
    # bearer token (a tenant), at most this many tokens each (0 = no sharing), for this many tenants.
    # Without auth every caller would be one tenant, so sharing then needs share_outputs_without_auth.
    suffix_cache_tokens: int = 65536
    suffix_cache_tenants: int = 64
    share_outputs_without_auth: bool = False
    # The suffix index of each prompt is kept (core/prompt_indexes.py, about 1.4 KB a token), at most
    # this many tokens in all (0 = off): a session whose prompt starts as an earlier one of its tenant's
    # indexes only what follows.
    prompt_index_cache_tokens: int = PROMPT_INDEX_TOKENS
    # A new session goes to the target replica this router last sent the most of its prompt's leading
    # blocks to (their K/V are probably in that replica's prefix cache; services/router/prefix_routing.py),
    # unless that replica holds more than prefix_routing_slack sessions beyond the least loaded one.
    prefix_routing: bool = True
    prefix_routing_slack: int = 2
    # Rounds a greedy session's target may run on its own after each Verify, where they would ask no
    # draft model (core/ahead.py); 0 = every round is the router's (a call each). Up to 8.
    max_ahead_rounds: int = MAX_AHEAD_ROUNDS
    # ... and how long a Verify call may run before such a round starts (0 = no bound): a stream's tokens
    # come in bursts of at most about this long plus a round (under load a round is a batch's forward).
    max_ahead_ms: float = 60.0

    def validate(self) -> RouterServiceSettings:
        super().validate()
        if not self.target_addresses:
            raise InvalidArgument("target_addresses must name at least one target service")
        if self.session_ttl_seconds < 1:
            raise InvalidArgument("session_ttl_seconds must be >= 1")
        if self.default_max_tokens < 1:
            raise InvalidArgument("default_max_tokens must be >= 1")
        if self.draft_timeout_seconds <= 0 or self.target_timeout_seconds <= 0:
            raise InvalidArgument("timeouts must be > 0")
        if not 0 <= self.http_port <= 65535:
            raise InvalidArgument(f"http_port must be in [0, 65535], got {self.http_port}")
        if self.http_max_body_bytes < 1024:
            raise InvalidArgument("http_max_body_bytes must be >= 1024")
        if self.redis_retry_seconds < 0:
            raise InvalidArgument("redis_retry_seconds must be >= 0")
        if self.prefix_routing_slack < 0:
            raise InvalidArgument("prefix_routing_slack must be >= 0")
        if self.suffix_cache_tokens < 0 or self.suffix_cache_tenants < 1:
            raise InvalidArgument("suffix_cache_tokens must be >= 0 and suffix_cache_tenants >= 1")
        if self.prompt_index_cache_tokens < 0:
            raise InvalidArgument("prompt_index_cache_tokens must be >= 0 (0 = off)")
        if not 0 <= self.max_ahead_rounds <= MAX_AHEAD_ROUNDS:
            raise InvalidArgument(f"max_ahead_rounds must be in [0, {MAX_AHEAD_ROUNDS}]")
        if not 0 <= self.max_ahead_ms < float("inf"):
            raise InvalidArgument(f"max_ahead_ms must be finite and >= 0, got {self.max_ahead_ms}")
        return self
