"""The drafts on int8 weights against the same drafts on float32, side by side in one bench run.

    python scripts/diagnostics/draft_weights_ab.py --workload grounded --max-new-tokens 256 \
        --out docs/results/draft-weights-ab-grounded.json

Two engines on the same target settings (the file's weights where `auto` gives them), one serving its
drafts on int8 weights and one on float32 (`draft_weights`), behind one bench harness: every prompt runs
`target` and each method on both engines, interleaved and rotated, each from an empty prefix cache
(`specserve bench`'s rules). A method's float32-draft run is named `<method>~dense`. Both engines size
trees by one target curve, measured now, and each by its own drafts' steps, measured now: the only
difference is the drafts' weights. No peer runs: it compares our code with itself.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="mt-bench")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--methods", default=DEFAULT_METHOD, help="comma-separated, besides `target`")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    costs = args.out.with_name(f"{args.out.stem}-costs")
    rounded = Engine(EngineSettings.from_env(draft_weights="int8", calibration_path=costs / "int8.json"))
    dense = Engine(EngineSettings.from_env(draft_weights="dense", calibration_path=costs / "dense.json"))
    measured = rounded.calibrate()
    about = {"model": rounded.settings.model, "verify": "one curve for both engines"}
    save_calibration(measured, costs / "int8.json", {**about, "drafts": "int8"})
    drafts = {kind: dense.drafts.measure_draft_cost(kind) for kind in CALIBRATED_DRAFTS}
    glide = drafts.pop(GLIDE_DRAFT)
    others = tuple((kind, c.step_s, c.overhead_s) for kind, c in drafts.items())
    dense_costs = CostModel(measured.verify_points, glide.step_s, glide.overhead_s, others)
    save_calibration(dense_costs, costs / "dense.json", {**about, "drafts": "dense"})
    prompts = load_prompts(resolve_prompts_path(args.workload))
    if args.per_category:
        prompts = per_category(prompts, args.per_category)
    methods = [m for m in args.methods.split(",") if m]
    methods += [f"{m}{DENSE}" for m in methods]
    request = GenerationRequest.build(method="target", max_new_tokens=args.max_new_tokens, ignore_eos=True)
    result = run_bench(TwoDraftWeights(rounded, dense), prompts, methods, request, settings=rounded.settings)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(result))


if __name__ == "__main__":
    main()
