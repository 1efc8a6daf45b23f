"""Target forwards at several libgomp spin-waits, with the cores to themselves and beside a busy core.

Each setting runs in a fresh process (libgomp reads GOMP_SPINCOUNT when torch loads): the served target
(packed weights, as the target service runs it), the median of 30 forwards of one token and of a 7-node
tree over a 150-token cache; `--busy N` keeps N more processes busy meanwhile. docs/benchmarks.md
(the distributed stack, "Cores shared with other work") quotes:

    python scripts/diagnostics/openmp_spin.py 0 100 1000 30000 default
    python scripts/diagnostics/openmp_spin.py 100 1000 3000 10000 default --busy 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

PARENTS = [-1, 0, 0, 0, 1, 1, 4]  # a 7-node tree, like a CaPE round
PREFIX = 150
REPEATS = 30


def measure() -> None:
    """In the child: prints `one_ms tree_ms`."""
    import torch

    from specserve.runtime.models import ServedModels
    from specserve.settings import EngineSettings

    runner = ServedModels(EngineSettings.from_env()).target_runner
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        cache = runner.new_cache(PREFIX + 64)
        runner.forward(cache, torch.randint(0, runner.vocab_size, (PREFIX,), generator=generator).tolist())
        tree = torch.randint(0, runner.vocab_size, (len(PARENTS),), generator=generator).tolist()

        def median_ms(tokens: list[int], parents: list[int]) -> float:
            times = []
            for _ in range(REPEATS + 2):
                start = time.perf_counter()
                runner.forward(cache, tokens, parents)
                cache.truncate(PREFIX)
                times.append(time.perf_counter() - start)
            return statistics.median(times[2:]) * 1e3

        print(f"{median_ms(tree[:1], [-1]):.1f} {median_ms(tree, PARENTS):.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spins", nargs="+", help="GOMP_SPINCOUNT values; 'default' leaves libgomp's own")
    parser.add_argument("--busy", type=int, default=0, metavar="N", help="processes keeping a core busy")
    args = parser.parse_args()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        for spin in args.spins:
            env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
            if spin != "default":
                env["GOMP_SPINCOUNT"] = spin
            out = subprocess.run(
                [sys.executable, __file__, "--child"], env=env, capture_output=True, text=True, check=True
            ).stdout.split()
            print(f"GOMP_SPINCOUNT={spin}: one token {out[-2]} ms, 7-node tree {out[-1]} ms", flush=True)
    finally:
        for process in busy:
            process.kill()
            process.wait()


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        measure()
    else:
        main()
