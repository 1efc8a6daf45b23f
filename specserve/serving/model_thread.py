"""One thread per service process for every tensor operation.

gRPC runs handlers on a pool of threads. OpenMP (torch's CPU backend) gives every calling thread its own
team of worker threads, so model calls spread over the pool leave several teams competing for the same
cores: measured on 2 cores, a 5-token target forward took ~30% longer when the calling thread varied
than on one dedicated thread (docs/benchmarks.md, the distributed stack). Handlers validate and hold
their locks on their own threads and hand the tensor work here, where forwards are batched.

Loading the model belongs here too. A second thread that ever ran torch (the main thread loading the
weights) leaves a second team behind, and once libgomp manages more threads than there are cores it
cuts its spin-wait between parallel regions to almost nothing, so every one of a forward's many small
regions pays a sleep and a wake-up: a 7-node tree verify took 98 ms with one team and 129 ms with two
(scripts/diagnostics/openmp_teams.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, ParamSpec, TypeVar

from specserve.runtime.batching import SchedulerThread
from specserve.serving import telemetry

P = ParamSpec("P")
R = TypeVar("R")


def _inference_mode() -> AbstractContextManager[object]:
    import torch  # the model services have it; this module stays importable without it

    return torch.inference_mode()


def run_inline(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """ModelThread.run's stand-in where no model thread is given (tests, tools): runs fn right here."""
    return fn(*args, **kwargs)


class ModelThread(SchedulerThread):
    """The service's one model thread. Every call runs there as a batching job (runtime/batching.py):
    concurrent requests' forwards are merged into one forward per model, continuously."""

    def __init__(self, name: str, **batching: Any) -> None:
        """batching: SchedulerThread's max_tokens_per_forward, max_queue, max_wait_seconds."""
        super().__init__(name, thread_context=_inference_mode, **batching)
        # Each batched forward gets a span linked to the spans of the requests it serves, where spans
        # are exported (telemetry.configure_tracing comes first in a service process).
        if telemetry.enabled():
            self.capture_trace = telemetry.current_span_context
            self.scheduler.batch_scope = telemetry.batch_span

    @contextmanager
    def alone(self) -> Iterator[None]:
        """Forwards run at once, waiting for no other job (`max_wait_seconds` 0), for the block: a service's
        warm-up, which measures the costs it publishes. With the wait, each of its forwards, the only job
        there is, waited out the whole batching window first: a target service measured a 1.5B's step at
        59.6 ms against 39.5 ms on a plain thread, its costs skewed by 20 ms a forward."""
        wait, self.max_wait_seconds = self.max_wait_seconds, 0.0
        try:
            yield
        finally:
            self.max_wait_seconds = wait

    @classmethod
    def for_settings(cls, name: str, settings: object) -> ModelThread:
        """A model thread with a service's batching settings (those it has; defaults for the rest)."""
        return cls(
            name,
            max_tokens_per_forward=getattr(settings, "max_tokens_per_forward", 1024),
            max_queue=getattr(settings, "max_queued_requests", 256),
            max_wait_seconds=getattr(settings, "batch_wait_ms", 0.0) / 1000,
        )
