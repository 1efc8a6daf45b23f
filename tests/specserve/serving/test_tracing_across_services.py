"""Spans of the three service processes form one trace per request, exported over real OTLP/gRPC.

The test runs an OTLP trace receiver in-process, starts a stack whose processes export to it through the
standard OTEL_* variables, sends one Generate carrying a W3C traceparent, stops the stack with SIGTERM and
checks the trace's shape:

    (test's client span, not exported)
    └─ router  SERVER /specserve.v1.RouterService/Generate
       └─ router  specserve.request
          ├─ router  CLIENT /specserve.v1.TargetService/Prefill ─ target SERVER ─ specserve.target.prefill
          └─ router  specserve.round (one per round)
             ├─ router CLIENT /specserve.v1.DraftService/Propose ─ draft SERVER ─ specserve.draft.propose
             └─ router CLIENT /specserve.v1.TargetService/Verify ─ target SERVER ─ specserve.target.verify
    plus the KV feed: draft SERVER Prefill ─ draft specserve.kv_feed.receive, and
                      target SERVER StreamKV ─ target specserve.kv_feed.publish

The router exports with a 10-minute batch delay, so its spans reach the receiver only if SIGTERM really
flushes them (serve_until_signal, then shutdown_tracing).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import Counter
from concurrent import futures
from dataclasses import dataclass

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from specserve.serving import telemetry
from specserve.serving.stack import LocalStack, free_port
from specserve.v1 import common_pb2, router_pb2, router_pb2_grpc

pytestmark = [pytest.mark.distributed, pytest.mark.model]

MAX_NEW_TOKENS = 16
SERVER = trace_pb2.Span.SPAN_KIND_SERVER
CLIENT = trace_pb2.Span.SPAN_KIND_CLIENT
ROUTER, DRAFT, TARGET = "specserve-router", "specserve-draft", "specserve-target"
PROPOSE_RPC = "/specserve.v1.DraftService/Propose"
VERIFY_RPC = "/specserve.v1.TargetService/Verify"


@dataclass(frozen=True)
class Span:
    service: str  # resource attribute service.name
    name: str
    kind: int
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root
    attributes: dict
    links: tuple[tuple[str, str], ...] = ()  # (trace id, span id) of each linked span


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context):
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    received.append(
                        Span(
                            service=resource.get("service.name", ""),
                            name=s.name,
                            kind=s.kind,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in s.links),
                        )
                    )
        with self.lock:
            self.spans += received
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[Span]:
        with self.lock:
            return list(self.spans)


def _value(value) -> object:
    return getattr(value, value.WhichOneof("value")) if value.WhichOneof("value") else None


@pytest.fixture
def receiver():
    collector = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port(f"localhost:{free_port()}")
    server.start()
    collector.port = port
    yield collector
    server.stop(0)


class TracedStack(LocalStack):
    """Every process exports to the receiver; the router only on shutdown (its batch delay is huge)."""

    def role_env(self, role: str) -> dict[str, str]:
        env = super().role_env(role)
        if role == "router":
            env["OTEL_BSP_SCHEDULE_DELAY"] = "600000"
        return env


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.mark.timeout(240)
def test_one_trace_spans_router_draft_and_target(receiver, tmp_path):
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://localhost:{receiver.port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "OTEL_SERVICE_NAME": "",  # the default names, specserve-<role>
        "SPECSERVE_DRAFT_PREPARE_AHEAD": "true",  # off by default; its spans are part of the trace
    }
    trace_id, client_span_id = secrets.token_hex(16), secrets.token_hex(8)
    with TracedStack(log_dir=tmp_path, env=env) as stack:
        with grpc.insecure_channel(stack.router_address) as channel:
            request = router_pb2.GenerateRequest(
                prompt="What is a tree?", max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True, method="glide-cape"
            )
            metadata = (("traceparent", f"00-{trace_id}-{client_span_id}-01"),)
            messages = list(
                router_pb2_grpc.RouterServiceStub(channel).Generate(request, metadata=metadata, timeout=120)
            )
        assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        stats = messages[-1].stats

        # Draft and target export every 200 ms; the router has sent nothing yet.
        def verify_servers() -> int:
            return sum(s.name == telemetry.SPAN_VERIFY for s in receiver.snapshot())

        wait_for(lambda: verify_servers() == stats.num_target_forwards - 1, 20, "the target's spans")
        assert not [s for s in receiver.snapshot() if s.service == ROUTER]
        for role in ("router", "draft", "target"):
            assert stack.terminate(role) == 0, (tmp_path / f"{role}.log").read_text()[-2000:]

    spans = [s for s in receiver.snapshot() if s.trace_id == trace_id]
    check_trace(spans, trace_id, client_span_id, stats)
    # Batched forwards are traces of their own, linked to the requests they served: every target
    # verify span of the request is linked from exactly one target batch span.
    batches = [s for s in receiver.snapshot() if s.name == telemetry.SPAN_BATCH]
    linked = [link for b in batches if b.service == TARGET for link in b.links if link[0] == trace_id]
    verifies = {s.span_id for s in spans if s.name == telemetry.SPAN_VERIFY and s.service == TARGET}
    assert verifies and {span_id for _, span_id in linked} >= verifies
    # Nothing of the request leaked into another trace (health checks, the router's lease renewals of the
    # sessions it holds, the costs drafts refresh from the target and batches are background work: traces
    # of their own).
    background = ("grpc.health", "SessionLeaseService/Renew", "TargetService/GetModelInfo")
    others = [
        s
        for s in receiver.snapshot()
        if s.trace_id != trace_id
        and not any(name in s.name for name in background)
        and s.name != telemetry.SPAN_BATCH
    ]
    assert not others, sorted({(s.service, s.name) for s in others})


def check_trace(spans: list[Span], trace_id: str, client_span_id: str, stats) -> None:
    by_id = {s.span_id: s for s in spans}
    assert len(by_id) == len(spans)

    def one(service: str, name: str, parent: Span | None = None, kind: int | None = None) -> Span:
        found = children(service, name, parent, kind)
        assert len(found) == 1, f"{service} {name} under {parent and parent.name}: {len(found)} spans"
        return found[0]

    def children(service: str, name: str, parent: Span | None = None, kind: int | None = None) -> list[Span]:
        return [
            s
            for s in spans
            if s.service == service
            and s.name == name
            and (parent is None or s.parent_id == parent.span_id)
            and (kind is None or s.kind == kind)
        ]

    # Every span's parent is in the trace, except the root's: the test's own (unexported) client span.
    roots = [s for s in spans if s.parent_id not in by_id]
    assert [(r.name, r.parent_id) for r in roots] == [
        ("/specserve.v1.RouterService/Generate", client_span_id)
    ]
    generate = roots[0]
    assert (generate.service, generate.kind) == (ROUTER, SERVER)
    request = one(ROUTER, telemetry.SPAN_REQUEST, generate)
    assert request.attributes[telemetry.ATTR_METHOD] == "glide-cape"

    prefill_client = one(ROUTER, "/specserve.v1.TargetService/Prefill", request, CLIENT)
    prefill_server = one(TARGET, prefill_client.name, prefill_client, SERVER)
    one(TARGET, telemetry.SPAN_PREFILL, prefill_server)

    rounds = children(ROUTER, telemetry.SPAN_ROUND, request)
    assert len(rounds) == stats.num_target_forwards - 1 >= 1
    generated = 1  # the prefill's token
    for round_span in rounds:
        propose_client = one(ROUTER, PROPOSE_RPC, round_span, CLIENT)
        propose_server = one(DRAFT, PROPOSE_RPC, propose_client, SERVER)
        propose = one(DRAFT, telemetry.SPAN_PROPOSE, propose_server)
        verify_client = one(ROUTER, VERIFY_RPC, round_span, CLIENT)
        verify_server = one(TARGET, VERIFY_RPC, verify_client, SERVER)
        verify = one(TARGET, telemetry.SPAN_VERIFY, verify_server)
        # The target verified the very tree the draft proposed.
        assert verify.attributes[telemetry.ATTR_TREE_SIZE] == propose.attributes[telemetry.ATTR_TREE_SIZE]
        assert propose.attributes[telemetry.ATTR_TREE_SIZE] >= 1
        accepted = verify.attributes[telemetry.ATTR_ACCEPTED_LENGTH]
        assert 0 <= accepted < verify.attributes[telemetry.ATTR_TREE_SIZE]
        generated += accepted + 1
    assert generated >= MAX_NEW_TOKENS  # the last round may overshoot; the loop trims it
    # The draft session was opened in the first round.
    draft_prefill_client = one(ROUTER, "/specserve.v1.DraftService/Prefill", kind=CLIENT)
    assert (
        draft_prefill_client.parent_id
        == min(rounds, key=lambda r: r.attributes["specserve.position"]).span_id
    )
    draft_prefill_server = one(DRAFT, draft_prefill_client.name, draft_prefill_client, SERVER)

    # The KV feed: the draft subscribes from its Prefill's context, the target publishes in StreamKV.
    receives = children(DRAFT, telemetry.SPAN_KV_RECEIVE, draft_prefill_server)
    assert receives and sum(s.attributes[telemetry.ATTR_POSITIONS] for s in receives) > 0
    # Trees built ahead when the feed delivered a commit, in the same context; Propose used them.
    prepares = children(DRAFT, telemetry.SPAN_PREPARE, draft_prefill_server)
    proposes = [s for s in spans if s.name == telemetry.SPAN_PROPOSE]
    used = sum(s.attributes[telemetry.ATTR_PREPARED] for s in proposes)
    assert 0 < used <= sum(s.attributes[telemetry.ATTR_PREPARED] for s in prepares)
    stream_servers = children(TARGET, "/specserve.v1.TargetService/StreamKV", draft_prefill_server, SERVER)
    assert stream_servers
    publishes = [s for s in spans if s.name == telemetry.SPAN_KV_PUBLISH]
    assert publishes and all(s.service == TARGET for s in publishes)
    assert {s.parent_id for s in publishes} <= {s.span_id for s in stream_servers}
    assert sum(s.attributes[telemetry.ATTR_BYTES] for s in publishes) > 0
    assert set(Counter(s.service for s in spans)) == {ROUTER, DRAFT, TARGET}
