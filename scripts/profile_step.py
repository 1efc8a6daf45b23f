"""Where one target forward's time goes: torch.profiler over one-token steps (and an n-token tree) of
the served runtime, per kernel path, side by side in one run.

    .venv/bin/python scripts/profile_step.py [--model-dir DIR] [--tokens 1] [--steps 20]

Prints, for each path (transformers' forward with torch's own linear kernel, then with packed oneDNN
weights; the lean forward with packed oneDNN weights), the median step time and the share of the
profiled time spent in the linear layers, attention, and everything else (norms, rotary, cache writes,
Python).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from specserve.models import load_causal_lm, resolve_model_dir
from specserve.runtime.calibrate import binary_tree_parents
from specserve.runtime.runner import ModelRunner
from specserve.settings import EngineSettings

LINEAR_OPS = ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::linear", "aten::matmul")
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention")
PREFIX = 200  # cached positions before each step, as in a short chat


def profile_path(runner: ModelRunner, tokens: int, steps: int) -> dict[str, float]:
    cache = runner.new_cache(PREFIX + tokens + 1)
    runner.forward(cache, list(range(100, 100 + PREFIX)), last_only=True)
    ids = list(range(5, 5 + tokens))
    parents = binary_tree_parents(tokens) if tokens > 1 else None

    def step() -> None:
        runner.forward(cache, ids, parents)
        cache.truncate(PREFIX)

    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    linear = sum(e.self_cpu_time_total for e in events if e.key in LINEAR_OPS)
    attention = sum(e.self_cpu_time_total for e in events if e.key in ATTENTION_OPS)
    return {
        "step_ms": statistics.median(times) * 1e3,
        "linear_share": linear / total,
        "attention_share": attention / total,
        "other_share": 1 - (linear + attention) / total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--tokens", type=int, default=1, help="tokens per forward (a tree when > 1)")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    settings = EngineSettings.from_env(model_dir=args.model_dir)
    if settings.num_threads > 0:
        torch.set_num_threads(settings.num_threads)
    model_dir = resolve_model_dir(settings.model_dir, settings.cache_dir)
    packed = load_causal_lm(model_dir, linear_kernel="auto")
    paths = {
        "transformers forward, native kernel": (load_causal_lm(model_dir, linear_kernel="native"), False),
        "transformers forward, packed oneDNN": (packed, False),
        "lean forward, packed oneDNN": (packed, True),
    }
    with torch.inference_mode():
        for label, (model, native_forward) in paths.items():
            runner = ModelRunner(model)
            if not native_forward:
                runner.native = None
            result = profile_path(runner, args.tokens, args.steps)
            print(
                f"{label:38s} {result['step_ms']:7.1f} ms/step  linear {result['linear_share']:5.1%}  "
                f"attention {result['attention_share']:5.1%}  other {result['other_share']:5.1%}"
            )


if __name__ == "__main__":
    main()
