"""One thread per service process for every tensor operation.

gRPC runs handlers on a pool of threads. OpenMP (torch's CPU backend) gives every calling thread its own
team of worker threads, so model calls spread over the pool leave several teams competing for the same
cores: measured on 2 cores, a 5-token target forward took ~30% longer when the calling thread varied
than on one dedicated thread (docs/benchmarks.md, section 3). Handlers validate and hold their locks on
their own threads and hand the tensor work here; one thread also serialises access to the model.

Loading the model belongs here too. A second thread that ever ran torch (the main thread loading the
weights) leaves a second team behind, and once libgomp manages more threads than there are cores it
cuts its spin-wait between parallel regions to almost nothing, so every one of a forward's many small
regions pays a sleep and a wake-up: a 7-node tree verify took 98 ms with one team and 129 ms with two
(scripts/diagnostics/openmp_teams.py).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def run_inline(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """ModelThread.run's stand-in where no model thread is given (tests, tools): runs fn right here."""
    return fn(*args, **kwargs)


class ModelThread:
    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def run(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Runs fn on the model thread and returns its result (its exception is re-raised here)."""
        return self._executor.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
