"""Tracing: one TracerProvider per process, configured by the standard OTEL_* variables, and gRPC
interceptors that propagate W3C trace context across services.

OTEL_TRACES_EXPORTER: "otlp" (OTLP/gRPC to OTEL_EXPORTER_OTLP_ENDPOINT), "console", or "none" (the
default when no endpoint is set: then no provider is installed, no interceptor is added and no span is
built around a forward). OTEL_SERVICE_NAME names the process (default: specserve-<role>).
Tests install their own in-memory exporter with `configure_tracing(role, exporter=...)`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import client_interceptor, server_interceptor
from opentelemetry.instrumentation.grpc.grpcext import intercept_channel
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter

TRACER_NAME = "specserve"

# Span names (one constant each, so dashboards and tests agree).
SPAN_REQUEST = "specserve.request"
SPAN_ROUND = "specserve.round"
SPAN_PROPOSE = "specserve.draft.propose"
SPAN_VERIFY = "specserve.target.verify"
SPAN_PREFILL = "specserve.target.prefill"
SPAN_KV_PUBLISH = "specserve.kv_feed.publish"
SPAN_KV_RECEIVE = "specserve.kv_feed.receive"
SPAN_PREPARE = "specserve.draft.prepare"  # a tree built ahead, when the KV feed delivered a commit
SPAN_BATCH = "specserve.batch"  # one batched forward; linked to the spans of the requests it served
ATTR_BATCH_SESSIONS = "specserve.batch.sessions"

# Attribute names.
ATTR_SESSION = "specserve.session_id"
ATTR_METHOD = "specserve.method"
ATTR_DRAFT_LENGTH = "specserve.draft_length"
ATTR_ACCEPTED_LENGTH = "specserve.accepted_length"
ATTR_AHEAD_ROUNDS = "specserve.ahead_rounds"  # rounds a target ran on its own after a Verify's tree
ATTR_TREE_SIZE = "specserve.tree_size"
ATTR_BYTES = "specserve.bytes"
ATTR_POSITIONS = "specserve.positions"
ATTR_PREPARED = "specserve.prepared"  # a Propose answered with a tree built ahead from the KV feed

_configured = False
_enabled = False


def configure_tracing(role: str, exporter: SpanExporter | None = None) -> None:
    """Installs the process's TracerProvider once, when spans go somewhere. `exporter` (tests) wins over
    the environment. With no exporter the API's no-op tracer stays and no span is opened: an SDK
    provider would still build every span and drop it; a span around each batched forward cost a
    one-token verify 3.6% (2.4% from the no-op tracer; scripts/diagnostics/span_cost.py on 2 cores),
    and the gRPC interceptors add spans on both ends of every call."""
    global _configured, _enabled
    if _configured:
        return
    _configured = True
    processor: SpanProcessor | None = None
    if exporter is not None:
        processor = SimpleSpanProcessor(exporter)
    else:
        env_exporter = _exporter_from_env()
        if env_exporter is not None:
            processor = BatchSpanProcessor(env_exporter)
    if processor is None:
        return
    name = os.environ.get("OTEL_SERVICE_NAME") or f"specserve-{role}"
    provider = TracerProvider(resource=Resource.create({"service.name": name, "specserve.role": role}))
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    _enabled = True


def enabled() -> bool:
    """Whether this process exports spans (configure_tracing found an exporter)."""
    return _enabled


def _exporter_from_env() -> SpanExporter | None:
    default = "otlp" if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") else "none"
    kind = os.environ.get("OTEL_TRACES_EXPORTER", default).strip().lower()
    if kind == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()  # endpoint, headers, TLS from OTEL_EXPORTER_OTLP_* variables
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    return None


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


@contextmanager
def span(name: str, **attributes: Any) -> Iterator[trace.Span]:
    with tracer().start_as_current_span(name, attributes=attributes) as current:
        yield current


def current_span_context() -> trace.SpanContext:
    """The caller's span, to be linked from the batch that serves it (runtime/batching.py)."""
    return trace.get_current_span().get_span_context()


@contextmanager
def batch_span(requests: list[object]) -> Iterator[trace.Span]:
    """A batched forward's span, linked to the span of every request whose segment it carries."""
    links = [trace.Link(c) for c in requests if isinstance(c, trace.SpanContext) and c.is_valid]
    with tracer().start_as_current_span(
        SPAN_BATCH, links=links, attributes={ATTR_BATCH_SESSIONS: len(requests)}
    ) as current:
        yield current


def shutdown_tracing() -> None:
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.force_flush()
        provider.shutdown()


def server_interceptors() -> list[grpc.ServerInterceptor]:
    """Extracts the caller's traceparent and opens a server span per RPC (none when nothing is exported)."""
    return [server_interceptor(tracer_provider=trace.get_tracer_provider())] if _enabled else []


def traced_channel(
    address: str, options: list[tuple[str, Any]], credentials: grpc.ChannelCredentials | None = None
) -> grpc.Channel:
    """A channel (TLS with `credentials`, else plaintext) whose calls carry the current trace context
    (W3C traceparent) when this process exports spans."""
    if credentials is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        channel = grpc.secure_channel(address, credentials, options=options)
    if not _enabled:
        return channel
    # The instrumentation's client interceptor plugs in through its own grpcext wrapper.
    return intercept_channel(channel, client_interceptor(tracer_provider=trace.get_tracer_provider()))
