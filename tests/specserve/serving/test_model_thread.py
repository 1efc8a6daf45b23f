"""ModelThread: every call runs on one and the same thread, whatever thread submits it."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

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
