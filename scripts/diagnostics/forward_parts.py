"""Where a target forward's time goes: the decoder layers (one call into the compiled library), the final
norm and head, and the rest (the embedding, the rotary tables, the batch's set-up, Python), for a
one-token step and for trees.

The model is loaded as `scripts/ab_step.py` loads it (weights as SPECSERVE_WEIGHTS says), a forward
runs after `--prefix` cached positions and is undone after, and each part's time is summed over
`--repeats` forwards by wrapping the methods that run it. docs/benchmarks.md ("The CPU's own kernels")
quotes:

    SPECSERVE_WEIGHTS=as-shipped python scripts/diagnostics/forward_parts.py --sizes 1,8 --threads 2
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ab_step  # the same loading and the same trees as the A/B script

from specserve.runtime import decoder, fused_layers

LAYERS, DECODER, HEAD = "decoder layers", "decoder forward", "norm and head"


def wrap(owner: type, name: str, label: str, spent: dict[str, float]) -> None:
    """owner.name, its time added to spent[label] on every call."""
    method: Callable[..., Any] = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - start

    setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,8", help="tokens per forward")
    parser.add_argument("--prefix", type=int, default=ab_step.PREFIX, help="cached positions first")
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spent: dict[str, float] = {}
    wrap(fused_layers.FusedLayers, "forward", LAYERS, spent)
    wrap(decoder.NativeDecoder, "forward", DECODER, spent)  # the layers plus embedding, rotary, plan
    wrap(decoder.NativeDecoder, "logits", HEAD, spent)
    with torch.inference_mode():
        runner, calibrate = ab_step.load_runner("specserve")
        for size in (int(n) for n in args.sizes.split(",")):
            step = ab_step.tree_step(runner, calibrate, size, args.prefix)
            for _ in range(5):
                step()
            spent.clear()
            start = time.perf_counter()
            for _ in range(args.repeats):
                step()
            whole = (time.perf_counter() - start) / args.repeats
            per = {label: seconds / args.repeats for label, seconds in spent.items()}
            if LAYERS not in per:
                print("this model does not run its layers in the compiled library", file=sys.stderr)
                return
            rest = whole - per[DECODER] - per[HEAD] + (per[DECODER] - per[LAYERS])
            print(
                f"{size:2d} tokens: whole {whole * 1e3:.2f} ms, decoder layers {per[LAYERS] * 1e3:.2f} ms, "
                f"norm and head {per[HEAD] * 1e3:.2f} ms, the rest {rest * 1e3:.2f} ms"
            )


if __name__ == "__main__":
    main()
