"""This checkout's target forward against another git revision's, interleaved in one process.

    .venv/bin/python scripts/ab_step.py [--baseline main] [--sizes 1,2,4,8,16] [--repeats 30]

On a shared machine two separate runs compare two loads, not two forwards: here both models (the
baseline's code copied from git under the package name `specserve_base`, weights from the same cache)
run one after the other for every repeat and size, alternating which goes first, after a 200-token
prefix (--prefix), and the ratio new / baseline of the medians is printed per size (1 = a one-token
step, more = a bushy tree, as `specserve calibrate` times; with --chain, a causal chain: a prompt's
prefill). First, each size's logits are compared bit for bit: a change meant to keep the numbers must
print True there. Weights as `SPECSERVE_WEIGHTS`
says (auto, the default: the file's own on a CPU; as-shipped; dense).
"""

from __future__ import annotations

import argparse
import importlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

PREFIX = 200  # cached positions before each timed forward (--prefix)
BASE = "specserve_base"
# an import of the package at a line's start (indented lazy imports too)
IMPORT = re.compile(r"^(\s*)(from|import) specserve(?=[.\s])", re.MULTILINE)


def baseline_package(revision: str, into: Path) -> None:
    """`revision`'s specserve/ under `into/specserve_base`, its own imports renamed to match."""
    root = Path(__file__).resolve().parent.parent
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", revision, "specserve"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "specserve").rename(into / BASE)
    for path in (into / BASE).rglob("*.py"):
        path.write_text(IMPORT.sub(rf"\1\2 {BASE}", path.read_text()))


def load_runner(package: str) -> tuple[object, ModuleType]:
    """The package's ModelRunner over the configured model, and its calibrate module (tree shapes)."""
    models = importlib.import_module(f"{package}.models")
    settings = importlib.import_module(f"{package}.settings").EngineSettings.from_env()
    runner_module = importlib.import_module(f"{package}.runtime.runner")
    model_dir = models.resolve_model_dir(settings.model_dir, settings.cache_dir, settings.model)
    shipped = None
    if getattr(settings, "resolved_weights", settings.weights) == "as-shipped":  # as the runtime decides
        install = importlib.import_module(f"{package}.models.install")
        profile = importlib.import_module(f"{package}.models.profiles").model_profile(settings.model)
        shipped = install.as_shipped_dir(profile, settings.cache_dir)
    model = models.load_causal_lm(model_dir, linear_kernel="auto", as_shipped=shipped)
    return runner_module.ModelRunner(model), importlib.import_module(f"{package}.runtime.calibrate")


def tree_step(
    runner: object, calibrate: ModuleType, tokens: int, prefix: int = PREFIX, chain: bool = False
) -> Callable[[], torch.Tensor]:
    """One forward of `tokens` tokens (a bushy tree when more than one; with `chain`, one causal chain:
    a prompt's prefill) after `prefix` cached positions, undone after."""
    cache = runner.new_cache(prefix + tokens + 1)  # type: ignore[attr-defined]
    ids = [100 + i % 1000 for i in range(prefix)]
    runner.forward(cache, ids, last_only=True)  # type: ignore[attr-defined]
    ids = list(range(5, 5 + tokens))
    parents = calibrate.binary_tree_parents(tokens) if tokens > 1 and not chain else None

    def step() -> torch.Tensor:
        logits = runner.forward(cache, ids, parents)  # type: ignore[attr-defined]
        cache.truncate(prefix)
        return logits

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="main", help="a git revision of this repository")
    parser.add_argument("--sizes", default="1,2,4,8,16", help="tokens per forward")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--prefix", type=int, default=PREFIX, help="cached positions before each forward")
    parser.add_argument(
        "--chain", action="store_true", help="a forward's tokens as one causal chain (a prefill)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(size) for size in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        baseline_package(args.baseline, Path(tmp))
        sys.path.insert(0, tmp)
        runners = {"base": load_runner(BASE), "new": load_runner("specserve")}
        steps = {
            (name, n): tree_step(*runners[name], n, args.prefix, args.chain)
            for name in runners
            for n in sizes
        }
        for n in sizes:
            same = torch.equal(steps["base", n](), steps["new", n]())
            print(f"{n:2d} tokens: logits bit-identical to the baseline's: {same}", flush=True)
        times: dict[tuple[str, int], list[float]] = {key: [] for key in steps}
        for repeat in range(args.repeats):
            for n in sizes:
                for name in ("base", "new") if repeat % 2 == 0 else ("new", "base"):
                    start = time.perf_counter()
                    steps[name, n]()
                    times[name, n].append(time.perf_counter() - start)
        one = {name: statistics.median(times[name, 1]) for name in runners} if 1 in sizes else None
        for n in sizes:
            base, new = (statistics.median(times[name, n]) for name in ("base", "new"))
            line = f"{n:2d} tokens: base {base * 1e3:7.2f} ms, new {new * 1e3:7.2f} ms"
            line += f": new/base {new / base:.3f}"
            if one is not None:
                line += f"  (one-token steps: base {base / one['base']:.2f}, new {new / one['new']:.2f})"
            print(line)


if __name__ == "__main__":
    main()
