"""Where a forward's layers spend their time, section by section, for a one-token step and for trees.

The CPU kernels are built again with `layer_sections.patch` (clocks between the sections of
`specserve_forward_layers`: the norms and residual adds, the q/k/v products, rotary, the K/V writes and
attention, the o product, the gate/up products, SiLU, the down product) and swapped into the served
target, as `kernel_variants.py` swaps its variants; a forward of each size runs after `--prefix` cached
positions, and each section's milliseconds a forward are printed with the whole forward's (the head and
the Python around the layers are the difference). The model is the configured one (SPECSERVE_MODEL).
docs/benchmarks.md ("Where a tree's rows go") quotes:

    python scripts/diagnostics/layer_sections.py --sizes 1,3,5,8 --prefix 128
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch
from kernel_variants import build_variants  # this directory's: the library built with a patch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ab_step  # the runtime's loading and the same trees

from specserve.runtime import calibrate, fused_layers

PATCH = Path(__file__).with_name("layer_sections.patch")
SECTIONS = ("norms, adds", "q/k/v", "rotary", "attention", "o", "gate/up", "SiLU", "down")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,3,5,8", help="tokens per forward (a bushy tree above 1)")
    parser.add_argument("--prefix", type=int, default=calibrate.PROMPT_TOKENS, help="cached positions first")
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        library = build_variants([PATCH], Path(tmp))[PATCH.stem]
        runner = ab_step.load_runner("specserve")[0]
        layers = [o for o in gc.get_objects() if isinstance(o, fused_layers.FusedLayers)]
        assert len(layers) == 1, "the served target runs its layers in one compiled call"
        call = library.specserve_forward_layers
        call.argtypes, call.restype = layers[0]._run.argtypes, None
        layers[0]._run = call
        seconds = (ctypes.c_double * len(SECTIONS))()
        sizes = [int(n) for n in args.sizes.split(",")]
        totals = {size: [0.0] * (len(SECTIONS) + 1) for size in sizes}  # the sections, then the whole
        with torch.inference_mode():
            steps = {size: ab_step.tree_step(runner, calibrate, size, args.prefix) for size in sizes}
            for step in steps.values():
                step()
            for _ in range(args.repeats):  # the sizes in turn, so the host's drift reaches each alike
                for size, step in steps.items():
                    library.specserve_section_reset()
                    start = time.perf_counter()
                    step()
                    totals[size][-1] += time.perf_counter() - start
                    library.specserve_section_times(seconds)
                    for i, value in enumerate(seconds):
                        totals[size][i] += value
        print(f"milliseconds a forward after {args.prefix} positions, the mean of {args.repeats}:")
        for size in sizes:
            parts = [value / args.repeats * 1e3 for value in totals[size]]
            cells = ", ".join(f"{name} {ms:.2f}" for name, ms in zip(SECTIONS, parts, strict=False))
            print(f"{size:2d} tokens: whole {parts[-1]:.2f}, layers {sum(parts[:-1]):.2f} ({cells})")


if __name__ == "__main__":
    main()
