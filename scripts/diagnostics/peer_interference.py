"""Methods on the same grounded prompts, one pass each, in the order given, in one process on the file's
weights: whether a method runs slower after transformers' `hf` has run beside it.

    python scripts/diagnostics/peer_interference.py suffix,eagle-cape-suffix,hf,suffix,eagle-cape-suffix

Each pass is 4 grounded prompts at 256 tokens (`hf:16` takes 16), every method from an empty prefix
cache, after one warm-up generation per method and a settled heap, as `specserve bench` runs them. It
prints tok/s and the target's verify time for each pass; docs/benchmarks.md ("The CPU's own kernels")
quotes it.
"""

from __future__ import annotations

import argparse
import json
import time

from specserve.bench.workloads import GROUNDED_PATH
from specserve.core.request import GenerationRequest
from specserve.engine import Engine
from specserve.runtime.target_runtime import settle_heap
from specserve.settings import EngineSettings

PROMPTS = (
    "grounded-summary-04",
    "grounded-extraction-03",
    "grounded-code-explanation-02",
    "grounded-summary-03",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", help="comma-separated passes: method or method:max_new_tokens")
    args = parser.parse_args()
    rows = [json.loads(line) for line in GROUNDED_PATH.read_text().splitlines() if line]
    texts = {row["question_id"]: row["turns"][0] for row in rows}
    engine = Engine(EngineSettings.from_env(weights="as-shipped"))
    passes = [
        (method, int(tokens or 256)) for method, _, tokens in (p.partition(":") for p in args.plan.split(","))
    ]
    for method in dict.fromkeys(m for m, _ in passes):
        engine.generate(texts[PROMPTS[0]], GenerationRequest.build(method=method, max_new_tokens=8))
    settle_heap()
    for method, tokens in passes:
        start, generated, verify_s = time.perf_counter(), 0, 0.0
        for question in PROMPTS:
            engine.reset_prefix_cache(engine.settings.prefix_cache_bytes)
            request = GenerationRequest.build(method=method, max_new_tokens=tokens, ignore_eos=True)
            result = engine.generate(texts[question], request)
            generated += len(result.token_ids)
            verify_s += result.stats.verify_s
        rate = generated / (time.perf_counter() - start)
        print(f"{method:20s} {tokens:4d} tokens: {rate:7.1f} tok/s, verify {verify_s:.3f} s", flush=True)


if __name__ == "__main__":
    main()
