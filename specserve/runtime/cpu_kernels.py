"""The CPU's own kernels for few-row forwards (C++ in `csrc/`, compiled on first use), each computing a
row the same way whatever the number of rows in the call, so a tree forward's rows equal the same tokens
decoded one at a time, bit for bit:

- `dot_mm` (`csrc/int4_dot.cpp`): 4-bit weights times rows rounded to int8 per group of 32, in
  integer dot products (AVX512-VNNI where the CPU has it, as llama.cpp's Q8 x Q4 products do, else
  AVX2's byte products in 16-bit sums), one pass over the weights for all the rows. torch's CPU int4
  kernel (`_weight_int4pack_mm_for_cpu`) decodes the weights again for every 4 rows, so a forward over
  8 or 16 tokens cost 2-4 one-token steps in its linear layers, and verification is where speculation
  pays or not. The integer sums are exact, so the AVX2 build and the portable one (any other CPU) give
  the VNNI build's bits (`DOT_PATHS`).
  The same for 8-bit weights (Q8_0, Q5_0, Q6_K: the file's signed integers in groups of 32 or 16),
  which would otherwise run as two 4-bit parts over a widened input (Q6_K's groups of 16 padded to 32:
  four times the file's bytes). The K-quants' scales stay in their file's form (an integer per group,
  a float per 256 inputs) instead of two float32 per group, which were a third of a Q4_K's bytes.
- `attend` (`csrc/attention.cpp`): float32 attention of each query row over the positions it sees, in
  the order a one-by-one decode would see them. torch's attention kernels round a row differently as
  the number of rows changes; without this the lean forward attends in float64 to make that noise vanish.
- `specserve_forward_layers` (`csrc/layers.cpp`, driven by runtime/fused_layers.py): a decoder's layers
  around those two, in one call per forward.

Numbers: the product's rows are rounded to int8 per group (scale amax / 127), as llama.cpp does for these
files; the weights are the file's own values. That is another approximation of the float32 model than
torch's kernel's (bfloat16 rows), measured in docs/benchmarks.md; speculation stays lossless either way,
since the target alone runs the same kernels.

The library is compiled with the machine's C++ compiler for the host's instruction set (`-march=native`),
once per source, compiler and CPU, into the cache (several processes may race: one build wins). Where no
compiler works, `library()` is None and the models stay on torch's kernels.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specserve.models.default_model import build_once
from specserve.models.gguf_quant import BlockScales
from specserve.settings import cpu_flags, default_cache_dir

logger = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name("csrc") / name for name in ("int4_dot.cpp", "attention.cpp", "layers.cpp")
)
LIBRARY_FILE = "specserve_cpu.so"
# what `specserve_dot_path()` says a build's products run on (the instruction set it was compiled for)
DOT_PATHS = {0: "portable", 1: "avx2", 2: "avx512-vnni"}
TILE = 16  # outputs per tile of the packed layout
GROUP = 32
# -ffp-contract=off: a fused multiply-add rounds once where the source rounds twice, and the vector and
# the scalar code must round alike. -fopenmp: torch's own OpenMP runtime (already loaded) runs the loops.
FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared", "-std=c++17")
MARCH = "native"
DISABLE_ENV = "SPECSERVE_CPU_KERNELS"  # "0": never build or use the library (torch's kernels everywhere)


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _cpu_flags() -> str:
    """The host's CPU feature flags: a library built with -march=native runs only where they match."""
    return cpu_flags() or os.uname().machine


def _build_key(compiler: str) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256()
    for part in (
        *(source.read_bytes() for source in SOURCES),
        " ".join((*FLAGS, MARCH)).encode(),
        version.encode(),
        _cpu_flags().encode(),
    ):
        digest.update(part)
    return digest.hexdigest()[:16]


def _cache_dir() -> Path:
    """Beside the models in the default cache: the library belongs to the host, not to a service's
    settings, and every process on the host shares one build."""
    return default_cache_dir() / "kernels"


def compile_library(compiler: str, out_dir: Path, march: str = MARCH) -> Path:
    """The library built for `march` (a -march value) into `out_dir`; raises RuntimeError on failure."""
    path = out_dir / LIBRARY_FILE
    command = [compiler, *FLAGS, f"-march={march}", *map(str, SOURCES), "-o", str(path)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
    return path


@functools.cache
def build_key() -> str | None:
    """What the kernels are built from on this host (their sources, flags, compiler and CPU), hashed; None
    without a compiler. Recorded costs carry it: a kernel changed or built for another CPU is timed
    afresh rather than priced by an older build's record (runtime/target_runtime.py `weights_label`)."""
    compiler = _compiler()
    if compiler is None:
        return None
    try:
        return _build_key(compiler)
    except (OSError, subprocess.SubprocessError):
        return None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None where they cannot be (no compiler, disabled)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C++ compiler: the models run on torch's kernels alone")
        return None
    key = build_key()
    if key is None:
        logger.warning("the CPU kernels' sources or compiler could not be read: torch's kernels instead")
        return None
    try:
        dest = _cache_dir() / f"cpu-{key}"
        build_once(dest, functools.partial(compile_library, compiler), description="CPU kernels")
        return load_library(dest / LIBRARY_FILE)
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        logger.warning("the CPU kernels did not build (%s): torch's kernels instead", error)
        return None


def load_library(path: Path) -> ctypes.CDLL:
    """A built library, its functions typed."""
    lib = ctypes.CDLL(str(path))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.specserve_dot_mm.argtypes = [pointer, size, size, size, size, size, *[pointer] * 4, size, pointer]
    lib.specserve_dot_mm.restype = ctypes.c_int
    lib.specserve_dot_path.restype = ctypes.c_int
    lib.specserve_attend.argtypes = [pointer, *[size] * 5, pointer, pointer, *[size] * 4, pointer]
    lib.specserve_attend.argtypes += [ctypes.c_float, pointer]
    lib.specserve_attend.restype = None
    lib.specserve_exp_shifted.argtypes = [pointer, size, ctypes.c_float]  # the layers' exp, for its tests
    lib.specserve_exp_shifted.restype = None
    # runtime/fused_layers.py types its structs' pointers itself
    lib.specserve_forward_layers.restype = None
    return lib


# the scales' layouts (csrc/int4_dot.cpp's ScaleKind); BLOCK_HALF_SCALES: block scales, fp16 supers
FLOAT_SCALES, BLOCK_SCALES, HALF_SCALES, BLOCK_HALF_SCALES = 0, 1, 2, 3


@dataclass(frozen=True)
class DotLayout:
    """A weight [N, K] packed for `dot_mm` (the layouts of csrc/int4_dot.cpp)."""

    # uint8, 4 bits: [N / 16, K / 32, 4, 64]; 8 bits: [N / 16, K / G, G / 4, 64]; 6 bits: [N / 16, K / G,
    # 3 G / 16, 64]
    codes: torch.Tensor
    scales: torch.Tensor  # float32 or float16 [N / 16, K / G, 16], or int8 [N / 16, K / G, F, 16] (block)
    biases: torch.Tensor | None  # 4 bits, per-group scales: as the scales, [N / 16, K / 32, 16]
    supers: torch.Tensor | None  # block: float32 or float16 [N / 16, K / 256, F, 16]
    bits: int
    group: int
    kind: int

    @property
    def outputs(self) -> int:
        return int(self.codes.shape[0]) * TILE

    @property
    def width(self) -> int:
        return int(self.codes.shape[1]) * self.group

    @property
    def nbytes(self) -> int:
        tensors = (self.codes, self.scales, self.biases, self.supers)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _per_tile(values: np.ndarray, dtype: type = np.float32) -> torch.Tensor:
    """[F, N, G] (a factor per output and group) -> [N / 16, G, F, 16] (F = 1 is dropped)."""
    factors, n, groups = values.shape
    laid: np.ndarray = values.astype(dtype).reshape(factors, n // TILE, TILE, groups).transpose(1, 3, 0, 2)
    out = np.ascontiguousarray(laid)
    return torch.from_numpy(out[:, :, 0] if factors == 1 else out)


def _group_scales(*values: np.ndarray) -> tuple[list[torch.Tensor], int]:
    """Float32 [N, G] per-group factors laid out per tile, in fp16 where every one of them is an fp16
    value (the files' own scales are: the same values in half the bytes), else in float32."""
    halves = [v.astype(np.float16) for v in values]
    exact = all(np.array_equal(h.astype(np.float32), v) for h, v in zip(halves, values, strict=True))
    if exact:
        return [_per_tile(h[None], np.float16) for h in halves], HALF_SCALES
    return [_per_tile(v[None]) for v in values], FLOAT_SCALES


def _block_scales(block: BlockScales, n: int, four_bit: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The int8 factors per group and the supers per 256 inputs, padded to `n` rows, and their kind: fp16
    where every super is an fp16 value (a file's are: the same values in half the bytes), else float32."""
    pad = n - block.d.shape[0]

    def rows(a: np.ndarray) -> np.ndarray:
        return np.concatenate([a, np.zeros((pad, a.shape[1]), dtype=a.dtype)]) if pad else a

    if four_bit:
        assert block.dmin is not None and block.m is not None, "a 4-bit block needs dmin and m (Q4_K)"
        factors = np.stack([rows(block.sc), rows(block.m)])
        supers = np.stack([rows(block.d), -rows(block.dmin)])
    else:
        factors, supers = rows(block.sc)[None], rows(block.d)[None]
    halves = supers.astype(np.float16)
    if np.array_equal(halves.astype(np.float32), supers):
        return _per_tile(factors, np.int8), _per_tile(halves, np.float16), BLOCK_HALF_SCALES
    return _per_tile(factors, np.int8), _per_tile(supers), BLOCK_SCALES


def pack(
    codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, block: BlockScales | None = None
) -> DotLayout:
    """4-bit codes uint8 [N, W] in 0..15, scales and zeros float32 [N, W // 32] (N a multiple of 16) ->
    the 4-bit layout: codes [N / 16, W / 32, 4, 64] (byte 4i+j of chunk c: output i's inputs 8c+j in the
    low nibble, 8c+4+j in the high one); biases (zero - 8 * scale: the code's offset folded in) or, with
    a Q4_K's `block` (its rows may stop short of N: padded with zeros), its factors."""
    n, width = codes.shape
    tiles, groups = n // TILE, width // GROUP
    # [tiles, 16 outputs, groups, 4 chunks, 2 halves, 4 inputs] -> [tiles, groups, chunk, output, input]
    grid = codes.reshape(tiles, TILE, groups, 4, 2, 4)
    low, high = grid[:, :, :, :, 0, :], grid[:, :, :, :, 1, :]
    packed = (low | (high << 4)).astype(np.uint8).transpose(0, 2, 3, 1, 4)  # [tiles, groups, 4, 16, 4]
    packed_codes = torch.from_numpy(np.ascontiguousarray(packed).reshape(tiles, groups, 4, 64))
    if block is not None:
        factors, supers, kind = _block_scales(block, n, four_bit=True)
        return DotLayout(packed_codes, factors, None, supers, 4, GROUP, kind)
    biases = zeros.astype(np.float32) - np.float32(8.0) * scales.astype(np.float32)
    (laid_scales, laid_biases), kind = _group_scales(scales.astype(np.float32), biases)
    return DotLayout(packed_codes, laid_scales, laid_biases, None, 4, GROUP, kind)


def pack8(q: np.ndarray, scales: np.ndarray, block: BlockScales | None = None) -> DotLayout:
    """q int8 [N, K] (the file's signed integers), scales float32 [N, K // G] (G = 16 or 32; N a multiple
    of 16) -> the scales (or with a Q6_K's `block` its factors) and the codes in the fewest bits the
    kernel takes: 6 where every q lies in -32..31 (Q6_K's, Q5_0's), else 8. The 8-bit layout: codes
    q + 128 [N / 16, K / G, G / 4, 64] uint8 (byte 4i+j of chunk c: output i's input 4c+j of the group);
    the 6-bit one: codes q + 32 [N / 16, K / G, 3 G / 16, 64], `_six_bit_chunks`."""
    n, width = q.shape
    group = width // scales.shape[1]
    tiles, groups = n // TILE, width // group
    six = q.size > 0 and int(q.min()) >= -32 and int(q.max()) <= 31
    offset, bits = (32, 6) if six else (128, 8)
    codes = (q.astype(np.int16) + offset).astype(np.uint8)
    grid = codes.reshape(tiles, TILE, groups, group // 4, 4).transpose(0, 2, 3, 1, 4)  # [t, g, chunk, 16, 4]
    vectors = np.ascontiguousarray(grid).reshape(tiles, groups, group // 4, 64)
    packed = torch.from_numpy(_six_bit_chunks(vectors) if six else vectors)
    if block is not None:
        factors, supers, kind = _block_scales(block, n, four_bit=False)
        return DotLayout(packed, factors, None, supers, bits, group, kind)
    (laid_scales,), kind = _group_scales(scales.astype(np.float32))
    return DotLayout(packed, laid_scales, None, None, bits, group, kind)


def _six_bit_chunks(vectors: np.ndarray) -> np.ndarray:
    """Code vectors [T, G', V, 64] of 6-bit codes (V = G / 4: vector v holds the group's inputs 4v..4v+3
    of the tile's 16 outputs) -> [T, G', 3 V / 4, 64]: their low 4 bits two vectors a chunk (2c in the low
    nibble, 2c+1 in the high, as the 4-bit layout), then their high 2 bits four vectors a chunk (vector
    4h+v in bits 2v..2v+1 of chunk h)."""
    low, high = vectors & 0x0F, vectors >> 4
    nibbles = low[:, :, 0::2] | (low[:, :, 1::2] << 4)
    v = vectors.shape[2]
    tops = high.reshape(*vectors.shape[:2], v // 4, 4, 64)
    crumbs = tops[:, :, :, 0] | tops[:, :, :, 1] << 2 | tops[:, :, :, 2] << 4 | tops[:, :, :, 3] << 6
    return np.ascontiguousarray(np.concatenate([nibbles, crumbs], axis=2).astype(np.uint8))


def dot_mm(x: torch.Tensor, layout: DotLayout, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """[M, K] float32 rows @ the packed weight [N, K].T -> [M, N] float32, on `lib` (default: `library()`,
    which must have built)."""
    lib = lib or library()
    assert lib is not None, "dot_mm needs the built library"
    rows = x.contiguous()
    m, width = rows.shape
    if width != layout.width:
        raise ValueError(f"input of {width} features for a weight of {layout.width}")
    out = torch.empty((m, layout.outputs), dtype=torch.float32)

    def pointer(t: torch.Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()

    status = lib.specserve_dot_mm(
        rows.data_ptr(), m, width, layout.bits, layout.group, layout.kind,
        layout.codes.data_ptr(), layout.scales.data_ptr(), pointer(layout.biases), pointer(layout.supers),
        layout.outputs, out.data_ptr(),
    )  # fmt: skip
    if status != 0:
        raise ValueError(
            f"no kernel for {layout.bits} bits in groups of {layout.group}, scales {layout.kind}"
        )
    return out


def attend(
    q: torch.Tensor,  # [n, Hq, D] float32, any strides with D contiguous
    keys: torch.Tensor,  # [1, Hkv, L, D] float32, D contiguous
    values: torch.Tensor,  # [1, Hkv, L, D], the keys' strides
    visible: torch.Tensor | None,  # [n, L] bool: position j is attended by row i; None = all
    scale: float,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """Each query row's attention over the positions it sees -> [n, Hq, D] float32 contiguous, a row's
    bits independent of the other rows, on `lib` (default: `library()`, which must have built)."""
    lib = lib or library()
    assert lib is not None, "attend needs the built library"
    n, heads, d = q.shape
    _, kv_heads, length, _ = keys.shape
    if q.stride(2) != 1 or keys.stride(3) != 1 or values.stride() != keys.stride():
        raise ValueError("attend needs the last axis contiguous and keys laid out as values")
    mask = None if visible is None else visible.to(torch.uint8).contiguous()
    out = torch.empty((n, heads, d), dtype=torch.float32)
    lib.specserve_attend(
        q.data_ptr(), n, heads, d, q.stride(0), q.stride(1),
        keys.data_ptr(), values.data_ptr(), kv_heads, length, keys.stride(1), keys.stride(2),
        None if mask is None else mask.data_ptr(), scale, out.data_ptr(),
    )  # fmt: skip
    return out
