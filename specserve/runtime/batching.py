"""Continuous batching: sessions run as cooperative jobs on one model thread, their forwards merged.

Each job is ordinary sequential code (a verify, a prefill, a draft proposal, or a whole in-process
generation) run in its own greenlet. When it needs a model forward it calls `batched_call`, which
suspends it; once every runnable job is suspended, the scheduler runs ONE forward per model over all of
their segments (`BatchedModel.forward_batch`) and resumes each job with its own result. Jobs that arrive
while a forward runs join the next one: there is no fixed window. Everything happens on one OS thread,
so torch keeps one OpenMP team per process (serving/model_thread.py explains why that matters).

Outside a scheduler `batched_call` just runs the one segment, so the same code serves a lone session.
So does a job inside `unbatched()`: a cost measurement that a session's first round starts (a host
with no calibration yet) times forwards of its own, not its segments merged with the other sessions'.

Thread-local state does not follow greenlets: a job that suspends inside `torch.inference_mode()` and
another that leaves its own would switch the mode under each other. So the thread that drives jobs
holds such modes once, around all of them (`thread_context`), and the jobs' own enters and exits then
never change anything.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast

import greenlet

from specserve.errors import Cancelled, ResourceExhausted

S = TypeVar("S")  # a model's segment type
R = TypeVar("R")  # its per-segment result
S_contra = TypeVar("S_contra", contravariant=True)  # S, as a protocol parameter (only taken, never given)
ModelT = TypeVar("ModelT")  # a draft model a batcher runs
BatcherT = TypeVar("BatcherT")


class BatchedModel(Protocol[S_contra, R]):
    def forward_batch(self, segments: Sequence[S_contra]) -> list[R]:
        """One forward over every segment; results in the same order."""
        ...


def _priority(model: object) -> int:
    return int(getattr(model, "priority", 0))


def segment_tokens(segment: object) -> int:
    """Tokens a segment puts into a forward (the unit of the per-forward budget)."""
    return int(getattr(segment, "num_tokens", 1))


@dataclass
class _Request:
    model: Any
    segment: Any


class _Job(greenlet.greenlet):
    """One unit of work; `future` gets its return value or exception."""

    def __init__(self, fn: Callable[[], Any], future: Future[Any], seq: int, trace: object = None) -> None:
        super().__init__(self._main)
        self.fn, self.future, self.seq = fn, future, seq
        self.trace = trace  # the submitter's tracing context, linked from the forwards that serve it
        self.cancelled = False
        self.scheduler: Scheduler | None = None

    def _main(self, *_: object) -> None:  # the first switch passes the resume value; unused
        try:
            self.future.set_result(self.fn())
        except BaseException as exc:  # the job's own failure goes to its caller, never to the scheduler
            self.future.set_exception(exc)


@dataclass
class _Wait:
    ready: Callable[[], bool]


def wait_until(ready: Callable[[], bool]) -> None:
    """Suspends the calling job until `ready()` (checked before each forward); other jobs run meanwhile.

    Jobs of one session use it to take turns on state they share (a drafter's cache). Outside a job
    nothing else can make `ready` true, so it must already be.
    """
    current = greenlet.getcurrent()
    while not ready():
        if not isinstance(current, _Job):
            raise RuntimeError("wait_until would block forever outside a batching job")
        current.parent.switch(_Wait(ready))


_alone = threading.local()  # .depth: unbatched() blocks entered on this thread


@contextmanager
def unbatched() -> Iterator[None]:
    """Within it, this thread's forwards run at once and alone, even inside a job: the job keeps the
    thread (no other job runs meanwhile) until it leaves. For measurements, whose forwards must be
    their own whatever runs beside them."""
    _alone.depth = getattr(_alone, "depth", 0) + 1
    try:
        yield
    finally:
        _alone.depth -= 1


def batched_call(model: BatchedModel[S, R], segment: S) -> R:
    """Runs `segment` through `model`: merged with other jobs' segments when called inside a job (and
    not `unbatched()`)."""
    current = greenlet.getcurrent()
    if isinstance(current, _Job) and not getattr(_alone, "depth", 0):
        return current.parent.switch(_Request(model, segment))
    return model.forward_batch([segment])[0]


@dataclass
class BatchStats:
    """What the scheduler did, for metrics and benchmarks."""

    forwards: int = 0
    segments: int = 0
    per_model: dict[str, tuple[int, int]] = field(default_factory=dict)  # label -> (forwards, tokens)
    # label -> seconds inside that model's forwards: the rest of a run's wall time is everything else
    # (drafting bookkeeping, sampling, scheduling), which is how a slow round is taken apart.
    seconds_per_model: dict[str, float] = field(default_factory=dict)


class Scheduler:
    """Runs jobs cooperatively and batches their forwards. Not thread-safe: one thread drives it.

    max_tokens_per_forward bounds a forward's total tokens (the oldest pending segment always goes,
    whatever its size, so nothing starves); jobs are served first in, first out.
    """

    def __init__(self, max_tokens_per_forward: int = 1024) -> None:
        self.max_tokens_per_forward = max_tokens_per_forward
        self._pending: list[tuple[_Job, _Request]] = []  # suspended jobs waiting for a forward, FIFO
        self._waiting: list[tuple[_Job, _Wait]] = []  # suspended jobs waiting for a condition
        self._seq = 0
        self._live = 0  # jobs started and not finished (see num_active)
        self.stats = BatchStats()
        self.on_batch: Callable[[int, int], None] | None = None  # (segments, tokens) per forward
        # Sessions a service knows to be active although not all have a job running right now (a draft
        # service sees a session only while it proposes); `sessions` takes the larger count.
        self.load_hint: Callable[[], int] | None = None
        # Wraps each forward, given the trace contexts of the jobs it serves (a tracing span).
        self.batch_scope: Callable[[list[object]], AbstractContextManager[object]] | None = None

    @property
    def busy(self) -> bool:
        return bool(self._pending or self._waiting)

    @property
    def num_active(self) -> int:
        """Jobs started and not finished. Counted, not read off the queues: while a forward's jobs are
        resumed one by one, those not resumed yet are in no queue, and the first resumed would see
        itself almost alone (then its cost policy drafts as if the batch were empty)."""
        return self._live

    def sessions(self) -> int:
        """Sessions whose segments share this scheduler's next forwards (>= 1): its jobs, or the load
        a service knows of (`load_hint`) when that is larger. Loops pass it to their drafters each
        round (core/loop.py), and cost policies size trees by it."""
        hinted = self.load_hint() if self.load_hint is not None else 0
        return max(1, self.num_active, hinted)

    @property
    def has_forwards(self) -> bool:
        return bool(self._pending)

    def start(self, fn: Callable[[], Any], future: Future[Any] | None = None, trace: object = None) -> _Job:
        """Starts a job now; it runs until its first forward (or to its end)."""
        self._seq += 1
        job = _Job(fn, future if future is not None else Future(), self._seq, trace)
        job.scheduler = self
        self._live += 1
        self._resume(job, None)
        return job

    def _resume(self, job: _Job, value: Any, error: BaseException | None = None) -> None:
        request = job.throw(error) if error is not None else job.switch(value)
        if job.dead:
            self._live -= 1
        elif isinstance(request, _Request):
            self._pending.append((job, request))
        elif isinstance(request, _Wait):
            self._waiting.append((job, request))

    def _wake(self) -> None:
        """Resumes cancelled jobs (with Cancelled) and waiting jobs whose condition holds."""
        progress = True
        while progress:
            progress = False
            for job, _ in [p for p in self._pending if p[0].cancelled]:
                self._pending = [p for p in self._pending if p[0] is not job]
                self._resume(job, None, Cancelled("the request was cancelled"))
                progress = True
            for item in list(self._waiting):
                job, wait = item
                if job.cancelled or wait.ready():
                    self._waiting.remove(item)
                    error = Cancelled("the request was cancelled") if job.cancelled else None
                    self._resume(job, None, error)
                    progress = True

    def step(self) -> None:
        """One forward per model over the oldest pending segments that fit the budget; resumes them."""
        self._wake()
        if not self._pending:
            return
        chosen: list[tuple[_Job, _Request]] = []
        tokens = 0
        for item in sorted(self._pending, key=lambda p: p[0].seq):
            size = segment_tokens(item[1].segment)
            if chosen and tokens + size > self.max_tokens_per_forward:
                continue
            chosen.append(item)
            tokens += size
        # Models of a lower `priority` go first: in process a round drafts (cheap forwards) before it
        # verifies, so sessions still drafting would otherwise split the target's batch in two.
        first = min(_priority(r.model) for _, r in chosen)
        chosen = [item for item in chosen if _priority(item[1].model) == first]
        chosen_ids = {id(job) for job, _ in chosen}
        self._pending = [p for p in self._pending if id(p[0]) not in chosen_ids]
        groups: dict[int, list[tuple[_Job, _Request]]] = {}
        for item in chosen:
            groups.setdefault(id(item[1].model), []).append(item)
        for group in groups.values():
            model = group[0][1].model
            segments = [request.segment for _, request in group]
            scope = self.batch_scope([job.trace for job, _ in group]) if self.batch_scope else nullcontext()
            started = time.perf_counter()
            try:
                with scope:
                    results = model.forward_batch(segments)
            except Exception as exc:  # a failed forward fails the jobs in it, not the scheduler
                for job, _ in group:
                    self._resume(job, None, exc)
                continue
            elapsed = time.perf_counter() - started
            self.stats.forwards += 1
            self.stats.segments += len(segments)
            batch_tokens = sum(segment_tokens(s) for s in segments)
            label = str(getattr(model, "label", type(model).__name__))
            forwards, model_tokens = self.stats.per_model.get(label, (0, 0))
            self.stats.per_model[label] = (forwards + 1, model_tokens + batch_tokens)
            self.stats.seconds_per_model[label] = self.stats.seconds_per_model.get(label, 0.0) + elapsed
            if self.on_batch is not None:
                self.on_batch(len(segments), batch_tokens)
            for (job, _), result in zip(group, results, strict=True):
                self._resume(job, result)

    def mark_cancelled(self, futures: set[Future[Any]]) -> None:
        for job, _ in [*self._pending, *self._waiting]:
            if job.future in futures:
                job.cancelled = True

    def run_all(
        self,
        fns: Sequence[Callable[[], R]],
        thread_context: AbstractContextManager[object] | None = None,
        max_live: int | None = None,
    ) -> list[R]:
        """Runs every fn as a job on this thread until all finish; returns their results in order.

        max_live: at most this many jobs at once, the next starting as soon as one finishes (a queue in
        front of a server that holds max_live sessions); None starts them all together."""
        if max_live is not None and max_live < 1:
            raise ValueError(f"max_live must be >= 1, got {max_live}")
        with thread_context if thread_context is not None else nullcontext():
            return self._run_all(fns, len(fns) if max_live is None else max_live)

    def _run_all(self, fns: Sequence[Callable[[], R]], max_live: int) -> list[R]:
        jobs: list[_Job] = []

        def admit() -> None:  # each started job runs to its first forward: it joins the next step
            while len(jobs) < len(fns) and self._live < max_live:
                jobs.append(self.start(fns[len(jobs)]))

        admit()
        while self.busy or len(jobs) < len(fns):
            self.step()
            admit()
            if self._waiting and not self._pending:
                self._wake()
                if not self._pending and self._waiting:
                    raise RuntimeError("every job waits on another and none can run")
        return [job.future.result() for job in jobs]


class SchedulerThread:
    """A model thread that serves jobs submitted from any thread, batching their forwards continuously.

    `max_queue` bounds jobs admitted but not finished:
    beyond it `submit` raises ResourceExhausted. `max_wait_seconds` > 0 lets a forward wait up to that
    long for more jobs when fewer than `max_tokens_per_forward` tokens are pending: for the jobs
    `expected_jobs()` says are coming (a service sets it to the sessions it served within the last
    second, so a forward does not leave without the sessions whose next requests are still on their way
    back from the router), or, without it, for the next job to arrive.
    """

    def __init__(
        self,
        name: str,
        max_tokens_per_forward: int = 1024,
        max_queue: int = 256,
        max_wait_seconds: float = 0.0,
        thread_context: Callable[[], AbstractContextManager[object]] | None = None,
    ) -> None:
        self.scheduler = Scheduler(max_tokens_per_forward)
        self._thread_context = thread_context  # held by the model thread around every job (module doc)
        self.max_queue = max_queue
        self.max_wait_seconds = max_wait_seconds
        self._cond = threading.Condition()
        self._inbox: deque[tuple[Callable[[], Any], Future[Any], float, object]] = deque()
        self._in_flight = 0
        self._cancelled: set[Future[Any]] = set()  # futures whose jobs should stop
        self.on_queue: Callable[[float], None] | None = None  # seconds from submit to job start
        self.capture_trace: Callable[[], object] | None = None  # the submitter's trace context
        self.expected_jobs: Callable[[], int] | None = None  # jobs a forward may wait for (class doc)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> Future[R]:
        future: Future[R] = Future()
        with self._cond:
            if self._closed:
                raise ResourceExhausted("the service is shutting down")
            if self._in_flight >= self.max_queue:
                raise ResourceExhausted(f"{self._in_flight} requests queued: the queue is full, retry later")
            self._in_flight += 1
            trace = self.capture_trace() if self.capture_trace is not None else None
            self._inbox.append((lambda: fn(*args, **kwargs), future, time.perf_counter(), trace))
            self._cond.notify()
        future.add_done_callback(self._finished)
        return future

    def run(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """Runs fn as a job and waits for its result (inline when called from a job or this thread)."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    def cancel(self, future: Future[Any]) -> None:
        """Marks the job of `future` cancelled: it gets Cancelled at its next forward, freeing its slot.

        A finished job is left alone (gRPC calls this when any RPC ends, also after a normal finish)."""
        if future.done():
            return
        with self._cond:
            self._cancelled.add(future)  # the object itself: an id could be reused by a later future
            self._cond.notify()

    def _finished(self, _: Future[Any]) -> None:
        with self._cond:
            self._in_flight -= 1

    def _loop(self) -> None:
        with self._thread_context() if self._thread_context is not None else nullcontext():
            self._serve()

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._inbox and not self.scheduler.has_forwards and not self._closed:
                    # nothing to run; jobs that only wait are woken by the jobs they wait for, or by
                    # a cancellation, so a short poll suffices
                    self._cond.wait(0.005 if self.scheduler.busy else None)
                    if self.scheduler.busy:
                        break
                if self._closed and not self._inbox and not self.scheduler.busy:
                    return
                if self.max_wait_seconds > 0 and not self._closed:
                    self._wait_for_more_jobs()
                arrivals = list(self._inbox)
                self._inbox.clear()
                cancelled, self._cancelled = self._cancelled, set()
            for fn, future, queued_at, trace in arrivals:
                if self.on_queue is not None:
                    self.on_queue(time.perf_counter() - queued_at)
                if future in cancelled:
                    future.set_exception(Cancelled("the request was cancelled"))
                    continue
                self.scheduler.start(fn, future, trace)
            self.scheduler.mark_cancelled(cancelled)
            if self.scheduler.busy:
                self.scheduler.step()

    def _wait_for_more_jobs(self) -> None:
        """With the lock held: waits up to max_wait_seconds for the jobs still expected."""
        deadline = time.perf_counter() + self.max_wait_seconds
        if self.expected_jobs is None:
            if not self._inbox_has_budget():
                self._cond.wait(self.max_wait_seconds)  # returns at the next submit
            return
        expected = self.expected_jobs()
        while not self._inbox_has_budget() and self.scheduler.num_active + len(self._inbox) < expected:
            remaining = deadline - time.perf_counter()
            if remaining <= 0 or self._closed:
                return
            self._cond.wait(remaining)

    def _inbox_has_budget(self) -> bool:
        pending = sum(segment_tokens(r.segment) for _, r in self.scheduler._pending)
        return pending + len(self._inbox) >= self.scheduler.max_tokens_per_forward

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=30)


_shared_batchers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def shared_batcher(model: ModelT, make: Callable[[ModelT], BatcherT]) -> BatcherT:
    """The one batcher of `model`, made by `make` on first use: drafters of the same model must share it
    to be batched together (a batcher each would run every session's forward alone)."""
    batcher = _shared_batchers.get(model)
    if batcher is None:
        batcher = _shared_batchers[model] = make(model)
    return cast(BatcherT, batcher)
