"""The CPU kernels against variants of themselves (the library built again with a patch applied to
specserve/runtime/csrc), timed in one process, interleaved pass by pass, so the host's drift hits every
variant alike.

Three measurements:
- products: 30 layers of the default model's four product shapes (random 4-bit codes with fp16 scales,
  about 80 MB, so the weights stream from memory as a forward's do), at each row count; the median over
  the passes of a sweep through all of them. `--bits 6`: instead the Q6_K tensors of
  Qwen2.5-Coder-1.5B's 14 layers that hold them (ffn_down and attn_v: random 6-bit integers in groups
  of 16 with fp16 scales, about 170 MB). `--bits 8`: the default model's head (its tied embedding,
  Q8_0: 49152 x 576 signed bytes in groups of 32 with fp16 scales, about 30 MB).
- `--attention`: 30 layers' attention of the default model's shape (9 query heads over 3 key/value
  heads of 64, each layer its own cache), rows as a chain's (each sees the prefix and the rows up to
  itself; one row sees every position, unmasked), at each row count and `--lengths` cached positions.
- `--forward`: the served target's whole forwards, each variant's `specserve_forward_layers` swapped into
  the one loaded model: a one-token step and trees of 5 and 8 nodes after 300 cached positions, and an
  85-token prefill (the size of a json-extraction prompt).

Every variant's outputs are compared with the unpatched library's and reported as the same bits or not
(a timing-only variant computes wrong values on purpose). docs/benchmarks.md ("The CPU's own kernels")
quotes:

    python scripts/diagnostics/kernel_variants.py scripts/diagnostics/product_epilogue_off.patch \
        --rows 8,64 --passes 21
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from product_rows import packed  # this directory's: the same random 4-bit weights

from specserve.runtime import calibrate, cpu_kernels, fused_layers

ROOT = Path(__file__).resolve().parents[2]
CSRC = Path("specserve/runtime/csrc")
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # q/k/v, o, gate/up, down (out, in)
LAYERS = 30
SIX_BIT_SHAPES = [(1536, 8960), (256, 1536)]  # the 1.5B's Q6_K ffn_down and attn_v (out, in)
SIX_BIT_LAYERS = 14  # half of its 28 layers hold them in Q6_K
SIX_BIT_GROUP = 16
HEAD_SHAPE = (49152, 576)  # the default model's Q8_0 head (out, in)
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
PREFIX = 300


def build_variants(patches: list[Path], directory: Path) -> dict[str, ctypes.CDLL]:
    """The unpatched library, then one per patch (applied to a copy of the sources)."""
    compiler = cpu_kernels._compiler()  # the one the library itself is built with
    assert compiler is not None, "no C++ compiler"
    libraries = {}
    for patch in [None, *patches]:
        name = "unpatched" if patch is None else patch.stem
        tree = directory / name
        shutil.copytree(ROOT / CSRC, tree / CSRC)
        if patch is not None:
            subprocess.run(["git", "apply", str(patch.resolve())], cwd=tree, check=True)
        sources = [tree / CSRC / source.name for source in cpu_kernels.SOURCES]
        library = tree / "library.so"
        command = [compiler, *cpu_kernels.FLAGS, f"-march={cpu_kernels.MARCH}", *map(str, sources), "-o"]
        subprocess.run([*command, str(library)], check=True)
        libraries[name] = cpu_kernels.load_library(library)
    return libraries


def interleaved(
    names: list[str], cases: list[str], passes: int, run: Callable[[str, str], tuple[float, torch.Tensor]]
) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], bool]]:
    """Median seconds of run(variant, case) over the passes, variants alternating in order; and whether
    each variant's output equals the first's."""
    times: dict[tuple[str, str], list[float]] = {(n, c): [] for n in names for c in cases}
    first: dict[tuple[str, str], torch.Tensor] = {}
    for index in range(passes):
        for case in cases:
            for name in names if index % 2 == 0 else list(reversed(names)):
                seconds, output = run(name, case)
                times[(name, case)].append(seconds)
                first.setdefault((name, case), output)
    same = {(n, c): torch.equal(first[(n, c)], first[(names[0], c)]) for n in names for c in cases}
    return {key: statistics.median(values) for key, values in times.items()}, same


def cells(
    names: list[str], case: str, medians: dict[tuple[str, str], float], same: dict[tuple[str, str], bool]
) -> str:
    """One case's line: each variant's median, and whether its output is the unpatched library's."""
    marks = {True: "", False: " (other bits)"}
    return ", ".join(f"{n} {medians[(n, case)] * 1e3:6.2f} ms{marks[same[(n, case)]]}" for n in names)


def six_bit(n: int, k: int, seed: int) -> cpu_kernels.DotLayout:
    """A random Q6_K-like weight [n, k]: integers in -32..31, an fp16 scale per group of 16."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-32, 32, (n, k)).astype(np.int8)
    scales = (rng.random((n, k // SIX_BIT_GROUP)) * 0.01).astype(np.float16).astype(np.float32)
    return cpu_kernels.pack8(q, scales)


def eight_bit(n: int, k: int, seed: int) -> cpu_kernels.DotLayout:
    """A random Q8_0-like weight [n, k]: integers in -127..127, an fp16 scale per group of 32."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-127, 128, (n, k)).astype(np.int8)
    scales = (rng.random((n, k // 32)) * 0.01).astype(np.float16).astype(np.float32)
    return cpu_kernels.pack8(q, scales)


def products(libraries: dict[str, ctypes.CDLL], rows: list[int], passes: int, bits: int) -> None:
    if bits == 6:
        weights = [six_bit(n, k, seed=i) for i, (n, k) in enumerate(SIX_BIT_SHAPES * SIX_BIT_LAYERS)]
    elif bits == 8:
        weights = [eight_bit(*HEAD_SHAPE, seed=0)]
    else:
        weights = [packed(n, k, seed=i) for i, (n, k) in enumerate(SHAPES * LAYERS)]
    widths = {w.width for w in weights}
    inputs = {
        r: {k: torch.randn(r, k, generator=torch.Generator().manual_seed(r)) for k in widths} for r in rows
    }

    def run(name: str, case: str) -> tuple[float, torch.Tensor]:
        r = int(case)
        start = time.perf_counter()
        outputs = [cpu_kernels.dot_mm(inputs[r][w.width], w, libraries[name]) for w in weights]
        return time.perf_counter() - start, torch.cat([o.flatten() for o in outputs])

    names = list(libraries)
    medians, same = interleaved(names, [str(r) for r in rows], passes, run)
    megabytes = sum(w.nbytes for w in weights) / 1e6
    what = {6: f"{SIX_BIT_LAYERS} layers", 8: "the head"}.get(bits, f"{LAYERS} layers")
    print(f"{bits}-bit products of {what} ({megabytes:.0f} MB), median of {passes}:")
    for r in rows:
        print(f"  {r:3d} rows: " + cells(names, str(r), medians, same))


def attention(libraries: dict[str, ctypes.CDLL], rows: list[int], lengths: list[int], passes: int) -> None:
    generator = torch.Generator().manual_seed(0)
    cases = {}
    for length in lengths:
        caches = [
            (torch.randn(1, KV_HEADS, length, HEAD_DIM, generator=generator),
             torch.randn(1, KV_HEADS, length, HEAD_DIM, generator=generator))
            for _ in range(LAYERS)
        ]  # fmt: skip
        for r in rows:
            q = torch.randn(r, HEADS, HEAD_DIM, generator=generator)
            visible = torch.ones(r, length, dtype=torch.bool).tril(length - r)  # a chain's rows
            cases[f"{r} rows, {length}"] = (q, caches, None if r == 1 else visible)

    def run(name: str, case: str) -> tuple[float, torch.Tensor]:
        q, caches, visible = cases[case]
        start = time.perf_counter()
        outputs = [cpu_kernels.attend(q, k, v, visible, 0.125, libraries[name]) for k, v in caches]
        return time.perf_counter() - start, torch.cat([o.flatten() for o in outputs])

    names = list(libraries)
    medians, same = interleaved(names, list(cases), passes, run)
    print(f"attention of {LAYERS} layers ({HEADS} heads over {KV_HEADS} of {HEAD_DIM}), median of {passes}:")
    for case in cases:
        print(f"  {case:>16s} positions: " + cells(names, case, medians, same))


def forwards(libraries: dict[str, ctypes.CDLL], passes: int) -> None:
    from specserve.runtime.models import ServedModels
    from specserve.settings import EngineSettings

    runner = ServedModels(EngineSettings.from_env()).target_runner
    layers = [o for o in gc.get_objects() if isinstance(o, fused_layers.FusedLayers)]
    assert len(layers) == 1, "the served target runs its layers in one compiled call"
    calls = {}
    for name, library in libraries.items():
        call = library.specserve_forward_layers
        call.argtypes, call.restype = layers[0]._run.argtypes, None
        calls[name] = call
    cases = {
        "step": (1, None),
        "verify(5)": (5, calibrate.binary_tree_parents(5)),
        "verify(8)": (8, calibrate.binary_tree_parents(8)),
        "prefill(85)": (85, None),
    }
    cache = runner.new_cache(PREFIX + 100)

    def run(name: str, case: str) -> tuple[float, torch.Tensor]:
        size, parents = cases[case]
        prefill = case.startswith("prefill")
        layers[0]._run = calls[name]
        cache.truncate(0)
        runner.forward(cache, [100 + i for i in range(PREFIX)], last_only=True)
        start_length = 0 if prefill else PREFIX
        ids = [100 + i for i in range(size)] if prefill else [5 + i for i in range(size)]
        best, output = float("inf"), torch.empty(0)
        for _ in range(3 if prefill else 10):
            cache.truncate(start_length)
            start = time.perf_counter()
            output = runner.forward(cache, ids, parents, last_only=prefill)
            best = min(best, time.perf_counter() - start)
        return best, output

    names = list(libraries)
    with torch.inference_mode():
        medians, same = interleaved(names, list(cases), passes, run)
    print(f"whole target forwards (best of a few, median of {passes} passes; trees after {PREFIX} positions)")
    for case in cases:
        print(f"  {case:11s}: " + cells(names, case, medians, same))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("patches", nargs="+", type=Path, help="patches to specserve/runtime/csrc")
    parser.add_argument("--rows", default="1,8,64", help="row counts of the products")
    parser.add_argument("--passes", type=int, default=15)
    parser.add_argument("--forward", action="store_true", help="whole forwards instead of products")
    parser.add_argument("--bits", type=int, choices=(4, 6, 8), default=4, help="the products' codes")
    parser.add_argument("--attention", action="store_true", help="attention instead of products")
    parser.add_argument("--lengths", default="128,300,800", help="cached positions (--attention)")
    args = parser.parse_args()
    if cpu_kernels.library() is None:
        raise SystemExit("the CPU kernels are not built on this host")
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as directory:
        libraries = build_variants(args.patches, Path(directory))
        rows = [int(r) for r in args.rows.split(",")]
        if args.forward:
            forwards(libraries, args.passes)
        elif args.attention:
            attention(libraries, rows, [int(n) for n in args.lengths.split(",")], args.passes)
        else:
            products(libraries, rows, args.passes, args.bits)


if __name__ == "__main__":
    main()
