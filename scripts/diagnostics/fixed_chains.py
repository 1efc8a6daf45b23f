"""Methods given by name or by their axes (fixed chains such as `vanilla+chain-2`, which `specserve bench`
does not list), side by side in one process: each prompt runs every method in turn, rotated prompt by
prompt, each from an empty prefix cache; every output must equal the first method's. docs/benchmarks.md
(a 4-bit draft for Qwen2.5-Coder-1.5B) quotes:

    python scripts/diagnostics/fixed_chains.py --model qwen2.5-coder-1.5b-instruct \
        --methods target,vanilla+chain-1,vanilla+chain-2,vanilla+chain-3,vanilla-cape-cost
"""

from __future__ import annotations

import argparse
import time

from specserve.bench.prompts import load_prompts, per_category
from specserve.bench.runner import forget_prompts
from specserve.core.request import GenerationRequest
from specserve.engine import Engine
from specserve.settings import EngineSettings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model profile (default: SPECSERVE_MODEL's)")
    parser.add_argument(
        "--methods", required=True, help="comma-separated names or axes; the first is the base"
    )
    parser.add_argument("--per-category", type=int, default=1, help="MT-Bench first turns per category")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    engine = Engine(EngineSettings.from_env(model=args.model))
    methods = [m for m in args.methods.split(",") if m]
    for method in methods:  # warm-up: loads, calibrations
        engine.generate("Say hello.", GenerationRequest.build(method=method, max_new_tokens=8))
    totals = {m: [0, 0.0, 0] for m in methods}  # tokens, seconds, target forwards
    for i, prompt in enumerate(per_category(load_prompts(), args.per_category)):
        expected = None
        for method in methods[i % len(methods) :] + methods[: i % len(methods)]:
            forget_prompts(engine)
            request = GenerationRequest.build(
                method=method, max_new_tokens=args.max_new_tokens, ignore_eos=True
            )
            start = time.perf_counter()
            result = engine.generate(prompt.text, request)
            totals[method][1] += time.perf_counter() - start
            totals[method][0] += len(result.token_ids)
            totals[method][2] += result.stats.num_target_forwards
            expected = result.token_ids if expected is None else expected
            if result.token_ids != expected:
                raise SystemExit(f"{method} differs on prompt {i}")
    base = totals[methods[0]][0] / totals[methods[0]][1]
    for method, (tokens, seconds, forwards) in totals.items():
        rate = tokens / seconds
        print(f"{method:24s} {rate:7.2f} tok/s  {rate / base:.3f}x  {tokens / forwards:.2f} tokens a forward")
    print("every output identical to the first method's")


if __name__ == "__main__":
    main()
