"""Bytes a one-token step streams against this machine's memory bandwidth, per weights setting.

    .venv/bin/python scripts/roofline.py [--steps 30] [--only int8-dot]

For dense float32 weights (packed oneDNN) and the file's weights as shipped (int4 codes, scales and
zeros; on torch's int4 kernel, and on this project's int8-dot kernel with its compiled layers), prints the
weight bytes one step reads, the step's median time on the lean forward over a 200-token cache, the
bandwidth that implies, and the machine's streaming bandwidth (a sum over a 1 GiB tensor on every
thread): how far each path is from the memory bound, and how much of its step is not spent moving
weights. `--only` measures one of them (a large model's dense copy takes minutes to load); the model is
the settings' (`SPECSERVE_MODEL`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specserve.models import load_causal_lm, resolve_model_dir
from specserve.models.install import as_shipped_dir
from specserve.models.profiles import model_profile
from specserve.runtime.int4 import Int4Linear, Int4Product, Int4Weight
from specserve.runtime.kernels import FusedPart, FusedProduct, PackedLinear
from specserve.runtime.runner import ModelRunner
from specserve.settings import EngineSettings

PREFIX = 200
# --only's names: dense float32, or the file's weights on one of the 4-bit kernels
PATHS = {"dense": "dense float32", "torch": "as shipped, torch int4", "int8-dot": "as shipped, int8-dot"}


def stream_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second of a sum over a large float32 tensor (read once per pass), best of `repeats`."""
    data = torch.ones(int(gib * (1 << 30)) // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight a one-token step reads (an embedding lookup reads one row: not counted)."""
    holders: dict[int, object] = {}
    for module in model.modules():
        if isinstance(module, FusedPart):
            holders[id(module.product)] = module.product
        elif isinstance(module, Int4Linear):
            holders[id(module.int4)] = module.int4
        elif isinstance(module, PackedLinear):
            holders[id(module)] = module
    total = 0
    for holder in holders.values():
        if isinstance(holder, Int4Product):
            holder = holder.weight
        if isinstance(holder, Int4Weight):
            total += holder.nbytes
        elif isinstance(holder, PackedLinear | FusedProduct):
            out_features, in_features = holder.packed.size()
            total += out_features * in_features * 4  # float32
    return total


def step_seconds(model: torch.nn.Module, steps: int) -> float:
    runner = ModelRunner(model)
    cache = runner.new_cache(PREFIX + 2)
    runner.forward(cache, list(range(100, 100 + PREFIX)), last_only=True)
    times = []
    for _ in range(steps + 3):
        start = time.perf_counter()
        runner.forward(cache, [5])
        times.append(time.perf_counter() - start)
        cache.truncate(PREFIX)
    return statistics.median(times[3:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--only", choices=sorted(PATHS), help="measure this path alone")
    args = parser.parse_args()
    settings = EngineSettings.from_env()
    if settings.num_threads > 0:
        torch.set_num_threads(settings.num_threads)
    model_dir = resolve_model_dir(settings.model_dir, settings.cache_dir, settings.model)
    shipped = as_shipped_dir(model_profile(settings.model), settings.cache_dir)
    bandwidth = stream_bandwidth()
    print(f"streaming bandwidth: {bandwidth / 1e9:.1f} GB/s ({torch.get_num_threads()} threads)")
    with torch.inference_mode():
        for path, label in PATHS.items():
            if args.only is not None and path != args.only:
                continue
            if path == "dense":
                model = load_causal_lm(model_dir, linear_kernel="auto")
            else:
                model = load_causal_lm(model_dir, linear_kernel="auto", as_shipped=shipped, int4_kernel=path)
            size = weight_bytes(model)
            seconds = step_seconds(model, args.steps)
            bound = size / bandwidth
            print(
                f"{label:24s} {size / 1e6:7.1f} MB/step  step {seconds * 1e3:6.2f} ms  "
                f"{size / seconds / 1e9:5.1f} GB/s  memory bound {bound * 1e3:5.2f} ms "
                f"({bound / seconds:.0%} of the step)"
            )
            del model


if __name__ == "__main__":
    main()
