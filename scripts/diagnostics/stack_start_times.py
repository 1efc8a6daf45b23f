"""How long a local stack takes to start (Redis, target, draft, router, each SERVING), N starts in a row.

Times the whole start, as `specserve stack` waits for it, on the default model with the host's cached
costs (no measurement). Run it on two checkouts one after the other to compare them (docs/benchmarks.md,
"Starting the stack" quotes):

    python scripts/diagnostics/stack_start_times.py --starts 5
"""

from __future__ import annotations

import argparse
import statistics
import time

from specserve.serving.stack import LocalStack


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--starts", type=int, default=5)
    args = parser.parse_args()
    seconds = []
    for index in range(args.starts):
        began = time.monotonic()
        with LocalStack():
            seconds.append(time.monotonic() - began)
        print(f"start {index + 1}/{args.starts}: {seconds[-1]:.1f} s", flush=True)
    print(f"median {statistics.median(seconds):.1f} s, min {min(seconds):.1f} s, max {max(seconds):.1f} s")


if __name__ == "__main__":
    main()
