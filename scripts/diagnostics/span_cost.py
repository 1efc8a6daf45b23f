"""What a span around each batched forward costs: one-token verifies on a model thread, the arms
interleaved: no span, a span from the API's no-op tracer, and a span from an SDK provider that exports
nothing (what a service had installed when no exporter was set), each built as the service builds its
batch span (linked to the request's span context).

docs/benchmarks.md (rounds beside the target) quotes it:
`python scripts/diagnostics/span_cost.py` on the default configuration.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from specserve.core.protocols import DraftTree
from specserve.engine import Engine
from specserve.runtime.target import LocalVerifier
from specserve.serving import telemetry
from specserve.serving.model_thread import ModelThread

PROMPT = "Write a short story about a robot who learns to paint, in three paragraphs."
ROUNDS = 80  # one-token rounds per measurement; the median is reported
REPEATS = 7


def one_token_rounds(engine: Engine) -> float:
    """Median milliseconds of a one-token verify, on the thread that calls it."""
    verifier = LocalVerifier(engine.target_runner, 512)
    verifier.prefill(engine.encode_prompt(PROMPT), 0)
    seconds = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        verifier.verify(DraftTree.root_only(verifier.root_token), 0)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds) * 1e3


def batch_scope(tracer: trace.Tracer) -> Callable[[list[object]], AbstractContextManager[object]]:
    """The service's batch span (telemetry.batch_span), from `tracer`."""

    def scope(requests: list[object]) -> AbstractContextManager[object]:
        links = [trace.Link(c) for c in requests if isinstance(c, trace.SpanContext) and c.is_valid]
        attributes = {telemetry.ATTR_BATCH_SESSIONS: len(requests)}
        return tracer.start_as_current_span(telemetry.SPAN_BATCH, links=links, attributes=attributes)

    return scope


def main() -> None:
    engine = Engine()
    thread = ModelThread("spans", max_wait_seconds=0.0)
    arms = {
        "no span": None,
        "no-op tracer": batch_scope(trace.NoOpTracer()),
        "SDK provider, nothing exported": batch_scope(TracerProvider().get_tracer(telemetry.TRACER_NAME)),
    }
    medians: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(REPEATS):
        for name, scope in arms.items():
            thread.scheduler.batch_scope = scope
            thread.capture_trace = telemetry.current_span_context if scope is not None else None
            medians[name].append(thread.submit(one_token_rounds, engine).result())
        print({name: round(values[-1], 3) for name, values in medians.items()}, flush=True)
    base = statistics.median(medians["no span"])
    for name, values in medians.items():
        middle = statistics.median(values)
        print(f"{name}: {middle:.3f} ms a one-token verify ({middle / base:.3f}x no span)")
    thread.close()


if __name__ == "__main__":
    main()
