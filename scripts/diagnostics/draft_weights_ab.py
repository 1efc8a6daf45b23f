"""The drafts on rounded weights (int8 or int4) against the same drafts dense, side by side in one bench run.

    python scripts/diagnostics/draft_weights_ab.py --workload grounded --max-new-tokens 256 \
        --out docs/results/draft-weights-ab-grounded.json
    python scripts/diagnostics/draft_weights_ab.py --model qwen2.5-coder-1.5b-instruct --rounded int4 \
        --methods vanilla-cape-cost,llama.cpp --per-category 1 --max-new-tokens 96 --out runs/int4.json

Two engines on the same target settings (the file's weights where `auto` gives them), one serving its
drafts on `--rounded` weights and one `dense` (`draft_weights`: the one-layer drafts in float32, a
separate draft model on its file's weights), behind one bench harness: every prompt runs `target` and
each method on both engines, interleaved and rotated, each from an empty prefix cache (`specserve
bench`'s rules). A method's dense-draft run is named `<method>~dense`. Both engines size trees by one
target curve, measured now, and each by its own drafts' steps, measured now: the only difference is the
drafts' weights. llama.cpp's methods (`llama.cpp`, ...; LLAMA_SERVER) run once, as the peer.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from specserve.bench.llamacpp import WithLlamaCpp
from specserve.bench.prompts import load_prompts, per_category
from specserve.bench.report import format_table
from specserve.bench.runner import run_bench
from specserve.bench.workloads import resolve_prompts_path
from specserve.catalog import DEFAULT_METHOD
from specserve.core.cost import GLIDE_DRAFT, CostModel
from specserve.core.request import GenerationRequest
from specserve.engine import Engine
from specserve.runtime.calibrate import save_calibration
from specserve.runtime.models import CALIBRATED_DRAFTS
from specserve.settings import EngineSettings

DENSE = "~dense"


class TwoDraftWeights:
    """One EngineLike over two engines: `<method>~dense` runs on the float32-draft engine."""

    def __init__(self, rounded: Engine, dense: Engine) -> None:
        self.rounded, self.dense = rounded, dense
        self.settings = rounded.settings

    @property
    def methods(self) -> list[str]:
        return [*self.rounded.methods, *(f"{m}{DENSE}" for m in self.dense.methods)]

    def reset_prefix_cache(self, budget: int) -> None:
        self.rounded.reset_prefix_cache(budget)
        self.dense.reset_prefix_cache(budget)

    def generate(self, prompt, request, on_tokens=None):
        if request.method.endswith(DENSE):
            plain = GenerationRequest.build(
                method=request.method.removesuffix(DENSE),
                max_new_tokens=request.stopping.max_new_tokens,
                ignore_eos=request.stopping.ignore_eos,
            )
            return self.dense.generate(prompt, plain, on_tokens)
        return self.rounded.generate(prompt, request, on_tokens)

    def runtime_info(self) -> dict:
        return self.rounded.runtime_info()

    def encode_prompt(self, prompt: str) -> list[int]:  # the llama.cpp peer's token ids (one tokenizer)
        return self.rounded.encode_prompt(prompt)

    def decode(self, token_ids: list[int]) -> str:
        return self.rounded.decode(token_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="mt-bench")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--methods", default=DEFAULT_METHOD, help="comma-separated, besides `target`")
    parser.add_argument("--model", default=None, help="a model profile (default: SPECSERVE_MODEL's)")
    parser.add_argument("--rounded", choices=("int8", "int4"), default="int8", help="the tried drafts")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    costs = args.out.with_name(f"{args.out.stem}-costs")
    tried = costs / f"{args.rounded}.json"
    rounded = Engine(
        EngineSettings.from_env(model=args.model, draft_weights=args.rounded, calibration_path=tried)
    )
    untried = costs / "dense.json"
    dense = Engine(EngineSettings.from_env(model=args.model, draft_weights="dense", calibration_path=untried))
    measured = rounded.calibrate()
    about = {"model": rounded.settings.model, "verify": "one curve for both engines"}
    save_calibration(measured, tried, {**about, "drafts": args.rounded})
    drafts = {kind: dense.drafts.measure_draft_cost(kind) for kind in CALIBRATED_DRAFTS}
    glide = drafts.pop(GLIDE_DRAFT)
    others = tuple((kind, c.step_s, c.overhead_s) for kind, c in drafts.items())
    dense_costs = CostModel(measured.verify_points, glide.step_s, glide.overhead_s, others)
    save_calibration(dense_costs, untried, {**about, "drafts": "dense"})
    prompts = load_prompts(resolve_prompts_path(args.workload))
    if args.per_category:
        prompts = per_category(prompts, args.per_category)
    methods = [m for m in args.methods.split(",") if m]
    peers = [m for m in methods if m.startswith("llama.cpp")]  # run once: they have no drafts
    methods += [f"{m}{DENSE}" for m in methods if m not in peers]
    request = GenerationRequest.build(method="target", max_new_tokens=args.max_new_tokens, ignore_eos=True)
    engine: Any = TwoDraftWeights(rounded, dense)
    if peers:
        engine = WithLlamaCpp(engine, rounded.settings.model)
    try:
        result = run_bench(engine, prompts, methods, request, settings=rounded.settings)
    finally:
        if isinstance(engine, WithLlamaCpp):
            engine.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(result))


if __name__ == "__main__":
    main()
