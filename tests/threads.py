"""Running a test's work on several threads at once, its failures reported to the main thread."""

from __future__ import annotations

import threading
from collections.abc import Callable


def errors_in_threads(work: Callable[[int], None], count: int = 4) -> list[BaseException]:
    """Runs work(0) ... work(count - 1) on their own threads at once; what they raised."""
    errors: list[BaseException] = []

    def run(seed: int) -> None:
        try:
            work(seed)
        except BaseException as error:  # reported to the main thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(seed,)) for seed in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors
