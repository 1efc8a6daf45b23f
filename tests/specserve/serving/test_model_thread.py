"""ModelThread: every call runs on one and the same thread, whatever thread submits it."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from specserve.runtime.batching import batched_call
from specserve.serving.model_thread import ModelThread


def test_calls_from_many_threads_run_on_one_thread_and_return_their_results():
    model = ModelThread("test-model")
    try:
        with ThreadPoolExecutor(max_workers=4) as callers:
            results = list(
                callers.map(lambda i: model.run(lambda x: (x * x, threading.get_ident()), i), range(16))
            )
        assert [square for square, _ in results] == [i * i for i in range(16)]
        ran_on = {ident for _, ident in results}
        assert len(ran_on) == 1 and threading.get_ident() not in ran_on
    finally:
        model.close()


def test_an_exception_reaches_the_caller():
    model = ModelThread("test-model")
    try:
        with pytest.raises(ValueError, match="bad tree"):
            model.run(lambda: (_ for _ in ()).throw(ValueError("bad tree")))
        assert model.run(lambda: 7) == 7  # the thread survives a failed call
    finally:
        model.close()


class _Echo:
    """A model whose forward costs nothing: what a forward waits shows alone."""

    def forward_batch(self, segments):
        return list(segments)


def _forwards_seconds(model: ModelThread, count: int) -> float:
    def job() -> float:
        start = time.perf_counter()
        for i in range(count):
            assert batched_call(_Echo(), i) == i
        return time.perf_counter() - start

    return model.run(job)


def test_a_lone_job_waits_out_the_batching_window_unless_the_thread_runs_alone():
    """A service's warm-up measures its costs: its forwards must not wait for jobs that never come."""
    wait = 0.02
    model = ModelThread("test-model", max_wait_seconds=wait)
    try:
        assert _forwards_seconds(model, 6) >= 4 * wait  # what the warm-up measured before (the first went on)
        with model.alone():
            assert _forwards_seconds(model, 6) < wait
        assert model.max_wait_seconds == wait  # serving batches again
    finally:
        model.close()
