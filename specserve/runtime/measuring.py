"""One cost measurement at a time on a host: processes that share a cache directory take turns.

A local stack starts its target and draft services together, and on a first start both measure their
costs (the target's verify curve, the draft's step) while the other does. Each then times the other's
load: a 1.5B target's one-token step measured 62.8 ms that way against 35.4 ms alone, and the cost
policy sized every tree from it. So a measurement holds an exclusive lock on a file in the cache
directory (the one the records go to) while it runs; another process's measurement waits, then usually
finds the record written. A process's own nested measurements (a whole calibration measures the
target, then each draft) take the lock once. Replicas on other hosts, or with their own cache
directories, do not wait for each other: they do not share cores either, as a rule.
"""

from __future__ import annotations

import fcntl
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_NAME = ".measuring.lock"
_held = threading.local()  # the lock's depth on this thread


@contextmanager
def measuring_alone(cache_dir: Path) -> Iterator[None]:
    """Holds this host's measurement lock for `cache_dir` (waiting for another process's measurement to
    end first); re-entrant on one thread."""
    if getattr(_held, "depth", 0):
        _held.depth += 1
        try:
            yield
        finally:
            _held.depth -= 1
        return
    cache_dir.mkdir(parents=True, exist_ok=True)
    with (cache_dir / LOCK_NAME).open("a+b") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("another process on this host is measuring its costs: waiting for it to finish")
            start = time.monotonic()
            fcntl.flock(lock, fcntl.LOCK_EX)
            logger.info("measuring after waiting %.1f s", time.monotonic() - start)
        _held.depth = 1
        try:
            yield
        finally:
            _held.depth = 0
            fcntl.flock(lock, fcntl.LOCK_UN)
