"""Prometheus metrics of each service, on its own registry and port (/metrics).

Who may read them: with TLS (a certificate, key and CA in the service's settings) the port serves HTTPS
with the service's own certificate and asks every scraper for a client certificate signed by that CA,
whatever `tls_client_auth` says (that setting is about the gRPC API's callers; the router's are
public). Without a CA to check scrapers against, the port listens on loopback unless `metrics_host`
opens it wider, which is logged as a warning.

Names follow vLLM's (`<prefix>:spec_decode_num_drafts`, ...) with the prefix `specserve:` so existing
dashboards carry over; the ones nobody else exposes (draft RPC latency, KV-feed lag and bytes, bytes on
the wire per round) are added under the same prefix.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from specserve.serving import tls
from specserve.serving.settings import ServerSettings

logger = logging.getLogger(__name__)

PREFIX = "specserve:"
MAX_TRACKED_POSITION = 16  # per-position acceptance counts stop here (labels stay bounded)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_BYTES_BUCKETS = (256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)


def _histogram(
    registry: CollectorRegistry, name: str, doc: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS
) -> Histogram:
    return Histogram(PREFIX + name, doc, registry=registry, buckets=buckets)


def _counter(registry: CollectorRegistry, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
    return Counter(PREFIX + name, doc, labels, registry=registry)


def _gauge(registry: CollectorRegistry, name: str, doc: str) -> Gauge:
    return Gauge(PREFIX + name, doc, registry=registry)


_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_TOKEN_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048)


@dataclass
class BatchMetrics:
    """Continuous batching on a service's model thread (runtime/batching.py)."""

    batch_sessions: Histogram
    batch_tokens: Histogram
    queue_wait: Histogram

    @classmethod
    def create(cls, registry: CollectorRegistry, role: str) -> BatchMetrics:
        return cls(
            batch_sessions=_histogram(
                registry, f"{role}_batch_sessions", "Sessions' segments per forward", _BATCH_BUCKETS
            ),
            batch_tokens=_histogram(registry, f"{role}_batch_tokens", "Tokens per forward", _TOKEN_BUCKETS),
            queue_wait=_histogram(
                registry,
                f"{role}_queue_wait_seconds",
                "Request queued until its job started on the model thread",
            ),
        )

    def attach(self, model_thread: object) -> None:
        """Observes every forward and every job start of a ModelThread (serving/model_thread.py)."""

        def on_batch(segments: int, tokens: int) -> None:
            self.batch_sessions.observe(segments)
            self.batch_tokens.observe(tokens)

        model_thread.scheduler.on_batch = on_batch  # type: ignore[attr-defined]
        model_thread.on_queue = self.queue_wait.observe  # type: ignore[attr-defined]


# A connection must finish its TLS handshake and send its request within this long (Prometheus's
# default scrape timeout); one that stalls is closed, and holds only its own thread meanwhile.
CONNECTION_TIMEOUT_SECONDS = 10.0


class _Handler(WSGIRequestHandler):
    timeout = CONNECTION_TIMEOUT_SECONDS  # StreamRequestHandler.setup puts it on the connection

    def setup(self) -> None:
        super().setup()
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()  # here, on the connection's thread, under the timeout

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a line per scrape would drown the service's log


class _Server(ThreadingMixIn, WSGIServer):
    """A thread per connection. The TLS handshake runs on that thread, not in `accept`: prometheus_client's
    own server wraps the listening socket, so one connection that never handshakes stalls every scrape."""

    daemon_threads = True

    def __init__(self, host: str, port: int, context: ssl.SSLContext | None) -> None:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        self.address_family = family  # read by TCPServer.__init__ when it makes the socket (IPv4 or 6)
        self.context = context
        super().__init__((str(address[0]), port), _Handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        connection, address = self.socket.accept()
        if self.context is not None:
            connection = self.context.wrap_socket(connection, server_side=True, do_handshake_on_connect=False)
        return connection, address

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A scraper without a valid certificate, a plaintext request, a stalled connection: refused,
        # and not worth a traceback each.
        logger.debug("metrics connection from %s failed", client_address, exc_info=True)


@dataclass
class MetricsServer:
    server: _Server

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def metrics_tls(settings: ServerSettings) -> ssl.SSLContext | None:
    """HTTPS with the service's certificate when it has one; scrapers must then present a certificate
    signed by the service's CA (when it has one: without, they cannot be checked)."""
    if not tls.tls_enabled(settings):
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    if settings.tls_ca_file:
        context.load_verify_locations(settings.tls_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def scrapers_authenticated(settings: ServerSettings) -> bool:
    return tls.tls_enabled(settings) and bool(settings.tls_ca_file)


def metrics_host(settings: ServerSettings) -> str:
    """`metrics_host` when set; else the service's own host when scrapers must show a certificate, and
    loopback when anyone who reaches the port could read it."""
    if settings.metrics_host:
        return settings.metrics_host
    return settings.host if scrapers_authenticated(settings) else "127.0.0.1"


def serve_metrics(registry: CollectorRegistry, settings: ServerSettings) -> MetricsServer | None:
    """Serves /metrics on a daemon thread; None when `metrics_port` is 0 (off)."""
    if not settings.metrics_port:
        return None
    host = metrics_host(settings)
    context = metrics_tls(settings)
    try:
        server = _Server(host, settings.metrics_port, context)
    except OSError as e:
        raise OSError(f"cannot bind the metrics port {host}:{settings.metrics_port}: {e.strerror}") from None
    server.set_app(make_wsgi_app(registry))
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    if not scrapers_authenticated(settings) and not tls.is_loopback(host):
        logger.warning(
            "serving /metrics on %s:%d to anyone who reaches it (no CA to check scrapers' certificates); "
            "set tls_cert_file, tls_key_file and tls_ca_file, or keep metrics_host on loopback "
            "(docs/security.md)",
            host,
            settings.metrics_port,
        )
    return MetricsServer(server)


@dataclass
class RouterMetrics:
    registry: CollectorRegistry
    num_drafts: Counter
    num_draft_tokens: Counter
    num_accepted_tokens: Counter
    num_accepted_tokens_per_pos: Counter
    time_to_first_token: Histogram
    inter_token_latency: Histogram
    e2e_request_latency: Histogram
    draft_rpc_latency: Histogram
    verify_rpc_latency: Histogram
    redis_latency: Histogram
    round_bytes: Histogram
    running_requests: Gauge
    draft_fallbacks: Counter
    draft_calls_skipped: Counter
    target_rebuilds: Counter
    prompt_index_cached_tokens: Counter
    prompt_index_indexed_tokens: Counter

    @classmethod
    def create(cls) -> RouterMetrics:
        r = CollectorRegistry()
        return cls(
            registry=r,
            num_drafts=_counter(r, "spec_decode_num_drafts", "Speculation rounds"),
            num_draft_tokens=_counter(r, "spec_decode_num_draft_tokens", "Draft tokens"),
            num_accepted_tokens=_counter(r, "spec_decode_num_accepted_tokens", "Accepted draft tokens"),
            num_accepted_tokens_per_pos=_counter(
                r,
                "spec_decode_num_accepted_tokens_per_pos",
                "Accepted draft tokens by position in the accepted path (1 = first draft token)",
                ("position",),
            ),
            time_to_first_token=_histogram(r, "time_to_first_token_seconds", "Request start to first token"),
            inter_token_latency=_histogram(r, "inter_token_latency_seconds", "Time between streamed tokens"),
            e2e_request_latency=_histogram(r, "e2e_request_latency_seconds", "Request start to finish"),
            draft_rpc_latency=_histogram(
                r, "draft_rpc_latency_seconds", "Draft Propose call, as the router sees it"
            ),
            verify_rpc_latency=_histogram(
                r, "verify_rpc_latency_seconds", "Target Verify call, as the router sees it"
            ),
            redis_latency=_histogram(
                r, "redis_latency_seconds", "Session-state writes to Redis, one per call's rounds"
            ),
            round_bytes=_histogram(
                r, "round_bytes", "Propose + Verify bytes on the wire per Verify call", _BYTES_BUCKETS
            ),
            running_requests=_gauge(r, "num_requests_running", "Generations in progress"),
            draft_fallbacks=_counter(
                r, "num_draft_fallbacks", "Rounds verified without a draft (draft failed)"
            ),
            draft_calls_skipped=_counter(
                r,
                "num_draft_calls_skipped",
                "Rounds not asked of the draft: the load makes them the root alone",
            ),
            target_rebuilds=_counter(r, "num_target_rebuilds", "Target sessions rebuilt from history"),
            prompt_index_cached_tokens=_counter(
                r, "prompt_index_cached_tokens", "Prompt tokens whose suffix index came from the cache"
            ),
            prompt_index_indexed_tokens=_counter(
                r, "prompt_index_indexed_tokens", "Prompt tokens a session's suffix index indexed itself"
            ),
        )

    def count_prompt_index(self, cached: int, indexed: int) -> None:
        """One session's suffix index started: `cached` prompt tokens from the cache, `indexed` built."""
        self.prompt_index_cached_tokens.inc(cached)
        self.prompt_index_indexed_tokens.inc(indexed)

    def observe_round(self, num_draft_tokens: int, num_accepted: int, call: tuple[float, int] | None) -> None:
        """`call`: the seconds and bytes of the Verify call (and its Propose) the round went out in;
        None for a round the target ran on its own after another's call."""
        if call is not None:
            self.verify_rpc_latency.observe(call[0])
            self.round_bytes.observe(call[1])
        self.num_drafts.inc()
        self.num_draft_tokens.inc(num_draft_tokens)
        self.num_accepted_tokens.inc(num_accepted)
        for position in range(1, min(num_accepted, MAX_TRACKED_POSITION) + 1):
            self.num_accepted_tokens_per_pos.labels(position=str(position)).inc()


@dataclass
class TargetMetrics:
    registry: CollectorRegistry
    sessions: Gauge
    kv_positions_reserved: Gauge
    evictions: Counter
    verify_latency: Histogram
    prefill_latency: Histogram
    kv_feed_bytes: Counter
    kv_feed_subscribers: Gauge
    kv_positions_allocated: Gauge
    batching: BatchMetrics
    # The prefix cache (runtime/prefix_cache.py), in prompt tokens as vLLM counts its own: the hit rate
    # is hits / queries (over a window: rate(hits) / rate(queries)); the gauge is since the start.
    prefix_cache_queries: Counter
    prefix_cache_hits: Counter
    prefix_cache_hit_rate: Gauge
    prefix_cache_bytes: Gauge

    def observe_prefill(self, prompt_tokens: int, cached_tokens: int) -> None:
        observe_prefix_cache(self, "prefix_cache", prompt_tokens, cached_tokens)

    @classmethod
    def create(cls) -> TargetMetrics:
        r = CollectorRegistry()
        return cls(
            prefix_cache_queries=_counter(
                r, "prefix_cache_queries", "Prompt tokens prefilled, cached or not (fresh and rebuilds)"
            ),
            prefix_cache_hits=_counter(
                r, "prefix_cache_hits", "Of those, tokens whose K/V came from the prefix cache"
            ),
            prefix_cache_hit_rate=_gauge(
                r, "prefix_cache_hit_rate", "Prefix cache hits / queries since the service started"
            ),
            prefix_cache_bytes=_gauge(r, "prefix_cache_bytes", "Bytes the prefix cache holds"),
            kv_positions_allocated=_gauge(
                r, "kv_cache_allocated_positions", "KV positions the sessions' caches hold"
            ),
            batching=BatchMetrics.create(r, "target"),
            registry=r,
            sessions=_gauge(r, "target_sessions", "Sessions holding a KV cache"),
            kv_positions_reserved=_gauge(
                r, "kv_cache_reserved_positions", "KV positions reserved by sessions"
            ),
            evictions=_counter(r, "target_evictions", "Sessions evicted to fit the budget"),
            verify_latency=_histogram(r, "verify_latency_seconds", "Tree forward + acceptance + commit"),
            prefill_latency=_histogram(r, "prefill_latency_seconds", "Prompt (or rebuild) forward"),
            kv_feed_bytes=_counter(r, "kv_feed_sent_bytes", "KV-feed payload bytes sent"),
            kv_feed_subscribers=_gauge(r, "kv_feed_subscribers", "Open KV-feed streams"),
        )


class PrefixCacheMetrics(Protocol):
    registry: CollectorRegistry
    prefix_cache_queries: Counter
    prefix_cache_hits: Counter
    prefix_cache_hit_rate: Gauge


def observe_prefix_cache(
    metrics: PrefixCacheMetrics, name: str, prompt_tokens: int, cached_tokens: int
) -> None:
    """A prefill's prompt tokens and the cached ones among them; the hit rate since the start, from the
    counters `name`_queries_total and `name`_hits_total."""
    metrics.prefix_cache_queries.inc(prompt_tokens)
    metrics.prefix_cache_hits.inc(cached_tokens)
    queries = metrics.registry.get_sample_value(f"{PREFIX}{name}_queries_total") or 0.0
    hits = metrics.registry.get_sample_value(f"{PREFIX}{name}_hits_total") or 0.0
    metrics.prefix_cache_hit_rate.set(hits / queries if queries else 0.0)


@dataclass
class DraftMetrics:
    registry: CollectorRegistry
    sessions: Gauge
    propose_latency: Histogram
    kv_wait: Histogram
    kv_feed_lag: Histogram
    kv_feed_bytes: Counter
    kv_feed_resyncs: Counter
    proposals: Counter  # label how: "prepared" (built ahead from the KV feed) or "on_request"
    batching: BatchMetrics
    # The draft's prefix cache of mirrored prompt K/V (services/draft/prefix.py), counted as the target's
    # (TargetMetrics) in prompt tokens of sessions that mirror the target, under a draft_ prefix.
    prefix_cache_queries: Counter
    prefix_cache_hits: Counter
    prefix_cache_hit_rate: Gauge
    prefix_cache_bytes: Gauge
    # Positions of the drafters' own prompt K/V (their self-attention's, a separate draft model's) loaded
    # from the same cache instead of computed
    drafter_prefix_cache_hits: Counter

    def observe_prefill(self, prompt_tokens: int, cached_tokens: int) -> None:
        observe_prefix_cache(self, "draft_prefix_cache", prompt_tokens, cached_tokens)

    @classmethod
    def create(cls) -> DraftMetrics:
        r = CollectorRegistry()
        return cls(
            prefix_cache_queries=_counter(
                r, "draft_prefix_cache_queries", "Prompt tokens of sessions that mirror the target's K/V"
            ),
            prefix_cache_hits=_counter(
                r, "draft_prefix_cache_hits", "Of those, positions loaded from the draft's prefix cache"
            ),
            prefix_cache_hit_rate=_gauge(
                r, "draft_prefix_cache_hit_rate", "Draft prefix cache hits / queries since the start"
            ),
            prefix_cache_bytes=_gauge(r, "draft_prefix_cache_bytes", "Bytes the draft's prefix cache holds"),
            drafter_prefix_cache_hits=_counter(
                r, "drafter_prefix_cache_hits", "Drafters' own prompt K/V positions loaded from the cache"
            ),
            batching=BatchMetrics.create(r, "draft"),
            registry=r,
            sessions=_gauge(r, "draft_sessions", "Draft sessions"),
            propose_latency=_histogram(r, "propose_latency_seconds", "Propose handler time"),
            kv_wait=_histogram(r, "kv_wait_seconds", "Propose time spent waiting for the KV feed"),
            kv_feed_lag=_histogram(r, "kv_feed_lag_seconds", "Target commit to draft mirror, per chunk"),
            kv_feed_bytes=_counter(r, "kv_feed_received_bytes", "KV-feed payload bytes"),
            kv_feed_resyncs=_counter(r, "kv_feed_resyncs", "KV-feed reconnects (gap, epoch change, error)"),
            proposals=_counter(
                r, "draft_proposals", "Trees returned by Propose, by how they were built", ("how",)
            ),
        )
