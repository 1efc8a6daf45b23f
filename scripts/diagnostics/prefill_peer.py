"""A prompt's prefill (its forward and first token), specserve's target against llama.cpp's `llama-server`
on the same GGUF file and the same token ids, in one run: what a user waits before the first token.

The prompts are the input-grounded workload's documents, tokenized by the target's own tokenizer, cut to
each length and sent as ids to both (llama-server's `/completion` with one token to predict and
`cache_prompt` off; its own `timings.prompt_ms`, and the call's wall time around it). specserve's side
is the served target's forward of the whole prompt from an empty cache. Best of three each, alternating.
Needs `LLAMA_SERVER` (docs/benchmarks.md, "Weights as shipped"). docs/benchmarks.md ("The CPU's own
kernels") quotes:

    python scripts/diagnostics/prefill_peer.py --lengths 85,512,1024,1536
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from specserve.bench.llamacpp import PLAIN, LlamaServer, server_arguments, server_binary
from specserve.bench.workloads import GROUNDED_PATH
from specserve.engine import Engine
from specserve.models.install import locate_part
from specserve.models.profiles import model_profile

REPEATS = 3


def prompt_ids(engine: Engine, length: int) -> list[int]:
    """`length` ids of the grounded documents, one after another, as the target's tokenizer cuts them."""
    texts = [json.loads(line)["turns"][0] for line in GROUNDED_PATH.read_text().splitlines() if line]
    ids: list[int] = []
    for text in texts:
        ids += engine.encode_prompt(text)
        if len(ids) >= length:
            return ids[:length]
    raise SystemExit(f"the grounded workload has fewer than {length} tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="85,512,1024,1536", help="prompt lengths in tokens")
    args = parser.parse_args()
    engine = Engine()
    runner = engine.target_runner
    profile = model_profile(engine.settings.model)
    if len(profile.parts) != 1:
        raise SystemExit("this script runs on a profile whose GGUF is one file")
    threads = len(os.sched_getaffinity(0))
    arguments = server_arguments(PLAIN, locate_part(profile.parts[0]), None, threads)
    with tempfile.TemporaryDirectory() as logs:
        server = LlamaServer(server_binary(), arguments, Path(logs))
        try:
            for length in (int(n) for n in args.lengths.split(",")):
                ids = prompt_ids(engine, length)
                ours, theirs, theirs_wall = [], [], []
                for _ in range(REPEATS):
                    cache = runner.new_cache(length + 1)
                    with torch.inference_mode():
                        start = time.perf_counter()
                        runner.forward(cache, ids, last_only=True)
                        ours.append(time.perf_counter() - start)
                    body = {"prompt": ids, "n_predict": 1, "cache_prompt": False, "temperature": 0.0}
                    start = time.perf_counter()
                    response = server.complete(body)
                    theirs_wall.append(time.perf_counter() - start)
                    theirs.append(float(response["timings"]["prompt_ms"]) / 1e3)
                mine, peer, call = min(ours), min(theirs), min(theirs_wall)
                print(
                    f"{length:5d} tokens: specserve {mine * 1e3:8.1f} ms "
                    f"({mine / length * 1e3:.3f} ms a token), "
                    f"llama-server {peer * 1e3:8.1f} ms ({peer / length * 1e3:.3f}; its call "
                    f"{call * 1e3:.1f} ms): {peer / mine:.2f}x"
                )
        finally:
            server.close()


if __name__ == "__main__":
    main()
