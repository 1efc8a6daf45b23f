"""Does a forward over a chain of tokens give the same logits as one-token forwards, per dtype?

Same model, same tokens, same positions: 20 random 64-token prefixes, then 8 more tokens either one at a
time (how the target decodes alone) or in one forward (how a draft chain is verified). Prints the largest
logit difference and how many of the 160 rows change their argmax. docs/benchmarks.md, bfloat16.

    python scripts/diagnostics/dtype_rounding.py
"""

from __future__ import annotations

import torch

from specserve.models.loading import load_causal_lm, resolve_model_dir
from specserve.runtime.runner import ModelRunner
from specserve.settings import EngineSettings

PREFIX, CHAIN, TRIALS = 64, 8, 20


def compare(runner: ModelRunner, generator: torch.Generator) -> tuple[float, int]:
    tokens = torch.randint(0, runner.vocab_size, (PREFIX + CHAIN,), generator=generator).tolist()
    one_by_one = runner.new_cache(PREFIX + CHAIN)
    runner.forward(one_by_one, tokens[:PREFIX], last_only=True)
    single = torch.stack([runner.forward(one_by_one, [t])[0] for t in tokens[PREFIX:]])  # [CHAIN, V]
    at_once = runner.new_cache(PREFIX + CHAIN)
    runner.forward(at_once, tokens[:PREFIX], last_only=True)
    chain = runner.forward(at_once, tokens[PREFIX:])  # [CHAIN, V]
    flips = int((single.argmax(-1) != chain.argmax(-1)).sum())
    return (single - chain).abs().max().item(), flips


def main() -> None:
    model_dir = resolve_model_dir(None, EngineSettings.from_env().cache_dir)
    for dtype in ("float32", "bfloat16"):
        runner = ModelRunner(load_causal_lm(model_dir, dtype=dtype))
        generator = torch.Generator().manual_seed(0)
        results = [compare(runner, generator) for _ in range(TRIALS)]
        largest = max(diff for diff, _ in results)
        flips = sum(f for _, f in results)
        rows = TRIALS * CHAIN
        print(f"{dtype}: largest |logit difference| {largest:.3g}, argmax differs in {flips} of {rows} rows")


if __name__ == "__main__":
    main()
