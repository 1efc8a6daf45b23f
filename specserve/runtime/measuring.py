"""One cost measurement at a time on a host, and none while a service of the host is starting.

A local stack starts its target, draft and router services together, and on a first start the target
and the draft each measure their costs (the target's verify curve, the draft's step). Measured beside
another process's measurement or its start (importing torch, loading and warming up a model), each
times the other's work as its own: a 1.5B target's one-token step measured 62.8 ms that way against
35.4 ms alone, and the cost policy sized every tree from it. So the processes that share a cache
directory (the one the records go to) share one lock file there:

- a service holds it *shared* from the moment it starts until it serves (`starting_up`): any number of
  services start side by side;
- a measurement holds it *exclusively* (`measuring_alone`): it waits until no service is starting and
  no other measurement runs, and a service that starts meanwhile waits for it to end. A starting service
  gives its shared hold up while it waits to measure (two starting services that both want to measure
  would otherwise wait for each other), then takes it again until it serves.

A process's own nested measurements (a whole calibration measures the target, then each draft) take the
lock once. Replicas on other hosts, or with their own cache directories, do not wait for each other:
they do not share cores either, as a rule. A waiting process logs every few seconds, so a stack that
bounds a start's silence keeps waiting for it.
"""

from __future__ import annotations

import fcntl
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import IO

logger = logging.getLogger(__name__)

LOCK_NAME = ".measuring.lock"
WAIT_POLL_S = 0.05
WAIT_LOG_EVERY_S = 10.0

_held = threading.local()  # this thread's depth of measurements
_measuring = threading.Lock()  # one measuring thread per process: threads share a process's lock file
_starting: dict[Path, IO[bytes]] = {}  # cache dir -> the lock file a starting service holds shared


def _lock_path(cache_dir: Path) -> Path:
    cache_dir.mkdir(parents=True, exist_ok=True)
    return cache_dir / LOCK_NAME


def _take(lock: IO[bytes], mode: int, waiting_for: str) -> None:
    """flock(mode), polling so that a long wait logs a line every WAIT_LOG_EVERY_S."""
    try:
        fcntl.flock(lock, mode | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    logger.warning("waiting for %s on this host to finish", waiting_for)
    start = last_log = time.monotonic()
    while True:
        try:
            fcntl.flock(lock, mode | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            time.sleep(WAIT_POLL_S)
        if (now := time.monotonic()) - last_log >= WAIT_LOG_EVERY_S:
            logger.info("still waiting for %s (%.0f s)", waiting_for, now - start)
            last_log = now
    logger.info("went on after waiting %.1f s", time.monotonic() - start)


@contextmanager
def starting_up(cache_dir: Path) -> Iterator[None]:
    """Holds the host's lock for `cache_dir` shared while a service starts (waiting for a measurement
    that runs to end first): a measurement of another process waits until the service serves."""
    key = Path(cache_dir)
    if key in _starting:  # already starting: nested
        yield
        return
    try:
        lock = _lock_path(key).open("a+b")
    except OSError as e:  # e.g. a router whose home is read-only: it measures nothing anyway
        logger.warning("starting without the host's measuring lock (%s): %s", key, e)
        yield
        return
    with lock:
        _take(lock, fcntl.LOCK_SH, "another process's cost measurement")
        _starting[key] = lock
        try:
            yield
        finally:
            del _starting[key]
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextmanager
def measuring_alone(cache_dir: Path) -> Iterator[None]:
    """Holds the host's lock for `cache_dir` exclusively (waiting for other processes' measurements and
    starts to end first); re-entrant on one thread."""
    if getattr(_held, "depth", 0):
        _held.depth += 1
        try:
            yield
        finally:
            _held.depth -= 1
        return
    key = Path(cache_dir)
    with _measuring:
        own = _starting.get(key)  # this process's shared hold, while it starts: closed by starting_up
        with _lock_path(key).open("a+b") if own is None else nullcontext(own) as lock:
            fcntl.flock(lock, fcntl.LOCK_UN)  # a shared hold is not kept while waiting: see the docstring
            _take(lock, fcntl.LOCK_EX, "the other services' starts and cost measurements")
            _held.depth = 1
            try:
                yield
            finally:
                _held.depth = 0
                fcntl.flock(lock, fcntl.LOCK_UN)
                if own is not None:  # still starting: back to a shared hold until it serves
                    _take(lock, fcntl.LOCK_SH, "another process's cost measurement")
