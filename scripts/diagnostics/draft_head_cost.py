"""What a separate draft's output head costs in its one-token step, whole and cut.

Loads the profile's draft model twice, with its whole head and with the head cut to `--rows`
(runtime/draft_head.py), times one-token steps of the two after an 80-token prompt, alternating in
blocks (the host's speed drifts; median per head), and times the head's product alone at a few row
counts. docs/benchmarks.md ("A cheaper draft step") quotes:

    python scripts/diagnostics/draft_head_cost.py --model qwen2.5-coder-1.5b-instruct
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from specserve.runtime.models import ServedModels
from specserve.settings import EngineSettings

STEPS = 10
BLOCKS = 6


def median_ms(run: Callable[[], object]) -> float:
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def stepper(settings: EngineSettings) -> tuple[Callable[[], object], torch.nn.Module]:
    """One more token a call after an 80-token prompt, the cache rewound every block."""
    runner = ServedModels(settings).vanilla_draft_runner
    cache = runner.new_cache(256)
    runner.forward(cache, list(range(100, 180)), last_only=True)

    def step() -> object:
        if cache.length >= 80 + STEPS:
            cache.truncate(80)
        return runner.forward(cache, [200 + cache.length - 80], last_only=True)

    return step, runner.model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model profile with a separate draft")
    parser.add_argument("--rows", type=int, default=32768)
    args = parser.parse_args()
    with torch.inference_mode():
        whole, model = stepper(EngineSettings.from_env(model=args.model, draft_head_rows=0))
        cut, _ = stepper(EngineSettings.from_env(model=args.model, draft_head_rows=args.rows))
        times: dict[str, list[float]] = {"whole": [], "cut": []}
        for _ in range(BLOCKS):
            times["whole"].append(median_ms(whole))
            times["cut"].append(median_ms(cut))
        whole_ms, cut_ms = statistics.median(times["whole"]), statistics.median(times["cut"])
        weight = model.get_output_embeddings().weight  # [V, H]
        hidden = torch.randn(1, weight.shape[1], dtype=weight.dtype)  # [1, H]
        print(f"one-token draft step: whole head {whole_ms:.1f} ms, cut to {args.rows} rows {cut_ms:.1f} ms")
        for rows in (weight.shape[0], 65536, args.rows):
            part = weight[:rows].contiguous()
            head_ms = median_ms(lambda part=part: torch.nn.functional.linear(hidden, part))
            print(f"  head product alone, {rows:>6} rows: {head_ms:.1f} ms")


if __name__ == "__main__":
    main()
