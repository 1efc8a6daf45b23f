"""The default method in process over the MT-Bench first turns (one per category, greedy): tokens per
second and a digest of the outputs, to compare two checkouts of the engine run one after the other.

docs/benchmarks.md (the distributed stack) quotes, alternating the checkouts:

    python scripts/diagnostics/inprocess_rate.py
    (cd <other checkout> && PYTHONSAFEPATH=1 PYTHONPATH=. python <this script>)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import specserve
from specserve.bench.prompts import load_prompts, per_category
from specserve.catalog import DEFAULT_METHOD
from specserve.core.request import GenerationRequest
from specserve.engine import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    engine = Engine()
    request = GenerationRequest.build(method=DEFAULT_METHOD, max_new_tokens=args.max_new_tokens)
    engine.generate("warm up", GenerationRequest.build(method=DEFAULT_METHOD, max_new_tokens=8))
    tokens, seconds, outputs = 0, 0.0, []
    for prompt in per_category(load_prompts(), 1):
        start = time.perf_counter()
        result = engine.generate(prompt.text, request)
        seconds += time.perf_counter() - start
        tokens += len(result.token_ids)
        outputs.append(result.token_ids)
    digest = hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:12]
    print(f"{specserve.__file__}: {DEFAULT_METHOD} {tokens / seconds:.2f} tok/s, outputs {digest}")


if __name__ == "__main__":
    main()
