"""The CPU's int8-row 4-bit product (runtime/cpu_kernels.py): its values against the file's weights, a row's
bits independent of the rows beside it and of the path that computed it (AVX512-VNNI, AVX2 or portable),
and the choice of kernel."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from specserve.errors import FailedPrecondition, InvalidArgument
from specserve.models.gguf_quant import QuantizedWeight, decode
from specserve.runtime import cpu_kernels
from specserve.runtime.int4 import Int4Weight, resolve_int4_kernel
from tests.specserve.models.test_gguf_quant import random_blocks
from tests.specserve.runtime.test_int4 import random_weight

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C++ compiler on this host")


def packed_random(
    n: int, width: int, seed: int = 0, half: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """4-bit codes with float32 scales and zeros; `half`: scales and biases (zero - 8 * scale) that are
    fp16 values, as a file's are (multiples of 2^-10 and 2^-8 in a small range: every sum exact)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, (n, width), dtype=np.uint8)
    if half:
        scales = (rng.integers(5, 21, (n, width // 32)) / 1024).astype(np.float32)
        biases = (rng.integers(-25, 26, (n, width // 32)) / 256).astype(np.float32)
        return codes, scales, biases + np.float32(8.0) * scales
    scales = rng.uniform(0.005, 0.02, (n, width // 32)).astype(np.float32)
    zeros = rng.uniform(-0.1, 0.1, (n, width // 32)).astype(np.float32)
    return codes, scales, zeros


def dense(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray) -> np.ndarray:
    n, width = codes.shape
    grouped = codes.reshape(n, width // 32, 32).astype(np.float64) - 8.0
    return (grouped * scales[..., None] + zeros[..., None]).reshape(n, width)


def int8_rows(x: np.ndarray) -> np.ndarray:
    """Each group of 32 of each row rounded to 127 levels of its largest magnitude (what the kernel reads)."""
    m, width = x.shape
    groups = x.reshape(m, width // 32, 32).astype(np.float64)
    amax = np.abs(groups).max(-1, keepdims=True)
    scale = np.where(amax > 0, amax / 127.0, 1.0)
    return (np.clip(np.rint(groups / scale), -127, 127) * scale).reshape(m, width)


def test_the_product_is_the_files_weights_times_the_rows_rounded_to_int8():
    codes, scales, zeros = packed_random(48, 256)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(1))
    y = cpu_kernels.dot_mm(x, cpu_kernels.pack(codes, scales, zeros)).numpy()
    weights = dense(codes, scales, zeros)
    exact_rows = int8_rows(x.numpy()) @ weights.T
    # float32 accumulation of 8 group terms: far below the int8 rounding the next check allows for
    np.testing.assert_allclose(y, exact_rows, rtol=0, atol=1e-5 * np.abs(exact_rows).max())
    unrounded = x.numpy().astype(np.float64) @ weights.T
    assert np.abs(y - unrounded).max() <= 0.02 * np.abs(unrounded).max()
    assert np.abs(y - unrounded).max() > 1e-5 * np.abs(unrounded).max()  # the rows were rounded


def signed_random(
    n: int, width: int, group: int, seed: int = 0, half: bool = False, bits: int = 8
) -> tuple[np.ndarray, np.ndarray]:
    """A signed integer weight as the 8-bit (or, `bits` 6, Q6_K's) formats ship it: q [N, K] int8, a
    scale per group (`half`: scales that are fp16 values, as a file's are)."""
    rng = np.random.default_rng(seed)
    top = 2 ** (bits - 1)
    q = rng.integers(-top, top, (n, width), dtype=np.int16).astype(np.int8)
    scales = rng.uniform(0.0005, 0.002, (n, width // group)).astype(np.float32)
    return q, scales.astype(np.float16).astype(np.float32) if half else scales


@pytest.mark.parametrize("bits", [6, 8])
@pytest.mark.parametrize("group", [16, 32])
def test_a_signed_product_is_the_files_integers_times_the_rows_rounded_to_int8(group, bits):
    """Signed integers on the 8-bit layout, or on the 6-bit one where they fit (-32..31: every edge
    value present, so a high bit lost in the packing shows)."""
    q, scale = signed_random(48, 256, group, bits=bits)
    if bits == 6:
        q[0, :64] = np.tile(np.arange(-32, 32, dtype=np.int8), 1)
    layout = cpu_kernels.pack8(q, scale)
    assert layout.bits == bits
    assert layout.codes.numel() == 48 * 256 * bits // 8
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(1))
    y = cpu_kernels.dot_mm(x, layout).numpy()
    weights = q.astype(np.float64) * np.repeat(scale, group, axis=1)
    exact_rows = int8_rows(x.numpy()) @ weights.T
    np.testing.assert_allclose(y, exact_rows, rtol=0, atol=1e-5 * np.abs(exact_rows).max())
    unrounded = x.numpy().astype(np.float64) @ weights.T
    assert np.abs(y - unrounded).max() <= 0.02 * np.abs(unrounded).max()


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_the_largest_codes_times_the_largest_row_values_sum_exactly(bits):
    """Every code at its largest or smallest value against rows rounded to +-127 throughout: the AVX2
    path's 16-bit partial sums are at their largest here, and one that saturated or wrapped would be off
    by thousands of a code's steps."""
    n, width = 32, 256
    top = 2 ** (bits - 1)
    signed = np.where(np.arange(n)[:, None] % 2 == 0, top - 1, -top).astype(np.int8).repeat(width, axis=1)
    signed[n // 2 :, ::3] = -top  # mixed outputs too
    scale = np.full((n, width // 32), 1 / 64, np.float32)
    if bits == 4:
        codes = (signed.astype(np.int16) + 8).astype(np.uint8)
        layout = cpu_kernels.pack(codes, scale, np.zeros_like(scale))
        weights = codes.astype(np.float64) - 8.0
    else:
        layout = cpu_kernels.pack8(signed, scale)
        weights = signed.astype(np.float64)
    assert layout.bits == bits
    x = torch.ones(4, width)
    x[1] = -1.0
    x[2, ::2] = -1.0
    x[3, : width // 2] = -1.0
    expected = int8_rows(x.numpy()) @ weights.T / 64
    np.testing.assert_allclose(cpu_kernels.dot_mm(x, layout).numpy(), expected, rtol=0, atol=1e-5 * 32)


def test_a_zero_row_and_a_zero_group_give_exact_zeros_and_no_nan():
    codes, scales, zeros = packed_random(16, 64)
    x = torch.zeros(2, 64)
    x[1, 32:] = torch.randn(32)  # row 1's first group is all zeros
    y = cpu_kernels.dot_mm(x, cpu_kernels.pack(codes, scales, zeros))
    assert torch.equal(y[0], torch.zeros(16))
    assert torch.isfinite(y).all()


def k_quant(type_name: str, n: int, width: int, seed: int) -> QuantizedWeight:
    return decode(type_name, random_blocks(type_name, n, width, seed), n, width)


def product_of(layout: str, n: int, width: int, seed: int, lib=None):
    """x -> x @ W.T for a random weight on one of the kernel's layouts: 4, 6 or 8 bits with float32
    scales, the same with fp16 ones ("4h", "6h", "8h"; 6 bits in groups of 32 too, as Q5_0's: "6h/32"),
    or a K-quant's block scales (Q4_K: 4 bits, Q6_K: 6 bits in groups of 16)."""
    if layout in ("4", "4h"):
        packed = cpu_kernels.pack(*packed_random(n, width, seed, half=layout == "4h"))
    elif layout in ("6", "6h", "6h/32", "8", "8h"):
        bits, group = int(layout[0]), 32 if layout.endswith("/32") else 16
        packed = cpu_kernels.pack8(*signed_random(n, width, group, seed, half="h" in layout, bits=bits))
        assert packed.bits == bits
    else:  # a K-quant: its supers fp16 as the file's ("Q4_K"), or float32 values ("Q4_K/32")
        w = k_quant(layout[:4], n, width, seed)
        if layout.endswith("/32"):
            w = dataclasses.replace(w, block=off_half(w.block))
        if layout.startswith("Q4_K"):
            packed = cpu_kernels.pack(w.codes[0], w.scales[0], w.zeros[0], w.block)
        else:
            signed = w.signed()
            assert signed is not None
            packed = cpu_kernels.pack8(*signed, w.block)
            assert packed.bits == 6
        half = cpu_kernels.BLOCK_SCALES if layout.endswith("/32") else cpu_kernels.BLOCK_HALF_SCALES
        assert packed.kind == half
    return lambda x: cpu_kernels.dot_mm(x, packed, lib=lib)


def off_half(block):
    """A K-quant's block scales with supers that are not fp16 values (each nudged by a float32 ulp)."""

    def nudged(a):
        return None if a is None else np.nextafter(a.astype(np.float32), np.float32(np.inf))

    return dataclasses.replace(block, d=nudged(block.d), dmin=nudged(block.dmin))


LAYOUTS = ["4", "4h", "6", "6h", "6h/32", "8", "8h", "Q4_K", "Q4_K/32", "Q6_K", "Q6_K/32"]


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's (and so the kernels' OpenMP) thread count for the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(threads, layout):
    """1 to 21 rows (blocks of 8 and their remainders), against each row computed alone."""
    product = product_of(layout, 64, 512, seed=2)
    x = torch.randn(21, 512, generator=torch.Generator().manual_seed(3))
    with torch_threads(threads):
        alone = [product(x[i : i + 1]) for i in range(21)]
        for m in (1, 2, 7, 8, 9, 16, 21):
            together = product(x[:m])
            for i in range(m):
                assert torch.equal(together[i], alone[i][0]), (m, i)


@pytest.mark.compute_only
@pytest.mark.parametrize(("march", "path"), [("x86-64", "portable"), ("x86-64-v3", "avx2")])
def test_every_path_gives_the_bits_of_this_hosts_build(tmp_path, march, path):
    """A host without AVX512-VNNI runs the AVX2 loops (x86-64-v3), one without AVX2 the portable ones
    (x86-64): built here for those levels, each must give this host's build's bits, so a model's outputs
    do not depend on which path ran them."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the other paths are compiled for an x86-64 level")
    compiler = cpu_kernels._compiler()
    assert compiler is not None
    other = cpu_kernels.load_library(cpu_kernels.compile_library(compiler, tmp_path, march=march))
    assert cpu_kernels.DOT_PATHS[other.specserve_dot_path()] == path
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(5))
    # rows whose quantization meets its edge cases: halves, which round to the even integer (amax 127
    # makes the factor exactly 1), and groups of zeros (no scale)
    halves = torch.arange(-63, 64, dtype=torch.float32) + 0.5
    x[3] = torch.cat([torch.tensor([127.0]), halves[:31]]).repeat(16)
    x[9, :256] = 0.0
    for layout in LAYOUTS:
        assert torch.equal(product_of(layout, 32, 512, 4, other)(x), product_of(layout, 32, 512, 4)(x)), (
            layout
        )


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_a_weight_on_int8_dot_matches_torchs_kernel_within_the_rounding_of_its_rows(type_name):
    """The same file's weight on both CPU kernels: the two approximations of the product (bf16 rows,
    int8 rows) stay within a percent of each other; padding rows (N not a multiple of 16) are dropped."""
    weight = random_weight(type_name, n=40, k=256)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(6))
    dot, torch_kernel = Int4Weight(weight, kernel="int8-dot"), Int4Weight(weight, kernel="torch")
    assert dot.compute_dtype == torch.float32
    y_dot, y_torch = dot.matmul(x), torch_kernel.matmul(x)
    assert y_dot.shape == y_torch.shape == (5, 40)
    assert (y_dot - y_torch).abs().max() <= 0.02 * y_torch.abs().max()


@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_0", "Q6_K"])
def test_the_signed_formats_run_on_their_own_integers_in_fewer_bytes(type_name):
    """Q8_0, Q5_0 and Q6_K on the file's own integers: the values of their two-part form (the torch
    kernel's), in fewer bytes (Q6_K: under half, its groups of 16 no longer padded to 32)."""
    from specserve.models.gguf_quant import split_signed

    if type_name == "Q6_K":  # the gguf package does not write Q6_K: its integers and scales, random
        q, scale = signed_random(40, 256, 16, seed=7)
        weight = split_signed((q.astype(np.int16) // 4).astype(np.int8), scale, 16, "Q6_K")
    else:
        weight = random_weight(type_name, n=40, k=256)
    eight, parts = Int4Weight(weight, kernel="int8-dot"), Int4Weight(weight, kernel="torch")
    assert eight.bits == 8 and parts.bits == 4
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(8))
    expected = torch.from_numpy(int8_rows(x.numpy()) @ weight.dequantize().astype(np.float64).T).float()
    y = eight.matmul(x)
    assert y.shape == (5, 40)
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
    # the two-part layout on 48 rows (tiles of 16): 4-bit codes, a float32 scale and bias per 32 inputs
    two_parts = 2 * 48 * (256 * 32 // weight.group) * (1 / 2 + 2 * 4 / 32)
    assert eight.nbytes <= (0.5 if weight.group == 16 else 0.75) * two_parts
    # Q6_K's and Q5_0's integers fit 6 bits and stream in them; Q8_0's take 8
    streamed = 8 if type_name == "Q8_0" else 6
    assert eight.dot_layout.bits == streamed
    assert eight.dot_layout.codes.numel() == 48 * 256 * streamed // 8
    # a weight that merely says Q6_K but is not two parts of one signed integer stays on the 4-bit kernel
    odd = type(weight)(weight.codes, weight.scales * 1.5, weight.zeros, weight.group, weight.source)
    assert Int4Weight(odd, kernel="int8-dot").bits == 4


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_k_quants_run_on_their_files_block_scales_in_fewer_bytes(type_name):
    """A K-quant's scales as the file holds them (an integer per group, a float per 256 inputs): the same
    products as from the float scales they give (Q6_K: bit for bit, its bias being -32 * scale; Q4_K:
    its bias -dmin * m is the file's exactly, where the float layout's is a rounded difference), and
    fewer bytes; a cut head's rows (40, padded to 48) keep theirs."""
    weight = k_quant(type_name, 40, 512, seed=9)
    blocked = Int4Weight(weight, kernel="int8-dot")
    floats = Int4Weight(dataclasses.replace(weight, block=None), kernel="int8-dot")
    assert blocked.dot_layout.kind == cpu_kernels.BLOCK_HALF_SCALES  # the file's supers are fp16 values
    assert floats.dot_layout.kind in (cpu_kernels.FLOAT_SCALES, cpu_kernels.HALF_SCALES)
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(10))
    y = blocked.matmul(x)
    if type_name == "Q6_K":
        assert torch.equal(y, floats.matmul(x))
    # the same supers in float32 (the layout taken where they are not fp16 values): the same bits, more bytes
    layout = blocked.dot_layout
    assert layout.supers is not None
    wide = dataclasses.replace(layout, supers=layout.supers.float(), kind=cpu_kernels.BLOCK_SCALES)
    assert torch.equal(cpu_kernels.dot_mm(x, wide)[:, :40], y)
    assert blocked.nbytes < wide.nbytes
    expected = torch.from_numpy(int8_rows(x.numpy()) @ weight.dequantize().astype(np.float64).T).float()
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
    assert blocked.nbytes <= 0.87 * floats.nbytes


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q5_0"])
def test_a_files_group_scales_stream_as_fp16_with_the_same_bits(type_name):
    """The files' per-group scales (and Q4_1's minimums) are fp16 values: laid out in fp16 they give the
    float32 layout's products bit for bit, in fewer bytes; scales that are not fp16 values stay float32."""
    weight = Int4Weight(random_weight(type_name, n=48, k=256), kernel="int8-dot")
    half = weight.dot_layout
    assert half.kind == cpu_kernels.HALF_SCALES and half.scales.dtype == torch.float16
    floats = dataclasses.replace(
        half,
        scales=half.scales.float(),
        biases=None if half.biases is None else half.biases.float(),
        kind=cpu_kernels.FLOAT_SCALES,
    )
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(11))
    assert torch.equal(cpu_kernels.dot_mm(x, half), cpu_kernels.dot_mm(x, floats))
    assert half.nbytes <= (0.84 if half.bits == 4 else 0.95) * floats.nbytes
    codes, scales, zeros = packed_random(48, 256)
    assert cpu_kernels.pack(codes, scales, zeros).kind == cpu_kernels.FLOAT_SCALES


def test_the_kernel_is_chosen_by_device_and_refused_where_it_cannot_run(monkeypatch):
    assert resolve_int4_kernel("auto", "cpu") == "int8-dot"
    assert resolve_int4_kernel("auto", "meta") == "torch"  # not a CPU: torch's kernel (CUDA's path)
    assert resolve_int4_kernel("torch", "cpu") == "torch"
    with pytest.raises(FailedPrecondition, match="int8-dot"):
        resolve_int4_kernel("int8-dot", "meta")
    with pytest.raises(InvalidArgument, match="int4_kernel"):
        resolve_int4_kernel("int3", "cpu")
    cpu_kernels.library.cache_clear()
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "0")
    try:
        assert cpu_kernels.library() is None
        assert resolve_int4_kernel("auto", "cpu") == "torch"
    finally:
        cpu_kernels.library.cache_clear()


def tree_case(n: int = 5, prefix: int = 7, heads: int = 6, kv_heads: int = 2, d: int = 64, seed: int = 7):
    """Queries of a 5-node tree over a cache of `prefix` positions plus the tree: q as a slice of a fused
    q/k product (strided, as the forward hands it over), keys and values as narrowed cache buffers."""
    from specserve.core.tree_mask import tree_attention_mask

    generator = torch.Generator().manual_seed(seed)
    fused = torch.randn(n, heads + kv_heads, d, generator=generator)
    length = prefix + n
    buffers = [torch.randn(1, kv_heads, length + 9, d, generator=generator) for _ in "kv"]
    keys, values = (buffer.narrow(2, 0, length) for buffer in buffers)
    visible = torch.ones(n, length, dtype=torch.bool)
    visible[:, prefix:] = tree_attention_mask([-1, 0, 0, 1, 2], visible.device)
    return fused[:, :heads], keys, values, visible


def reference_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor):
    """Grouped-query attention in float64 (torch's SDPA) -> [n, Hq, D], at the kernels' scale 0.125."""
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(
        q.transpose(0, 1)[None].double(), keys.double(), values.double(), attn_mask=visible[None, None],
        scale=0.125, enable_gqa=True,
    )[0].transpose(0, 1)  # fmt: skip


# (prefix, heads, kv_heads, head size): the vector loops' head sizes (64, 128) and another one; prefixes
# shorter than one block of 16 positions, across blocks, and with a partial last block
ATTENTION_CASES = [(7, 6, 2, 64), (40, 9, 3, 64), (33, 12, 2, 128), (21, 4, 2, 40)]


@pytest.mark.parametrize(("prefix", "heads", "kv_heads", "d"), ATTENTION_CASES)
def test_attention_is_grouped_query_attention_under_a_trees_mask(prefix, heads, kv_heads, d):
    q, keys, values, visible = tree_case(prefix=prefix, heads=heads, kv_heads=kv_heads, d=d)
    got = cpu_kernels.attend(q, keys, values, visible, 0.125)
    assert got.shape == q.shape and got.is_contiguous()
    torch.testing.assert_close(
        got.double(), reference_attention(q, keys, values, visible), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize(("prefix", "heads", "kv_heads", "d"), ATTENTION_CASES)
def test_a_tree_nodes_attention_is_its_path_decoded_alone_bit_for_bit(prefix, heads, kv_heads, d):
    """Node i of the tree sees the prefix and its ancestors: the same bits as its path's last token
    attending, one row, over a cache holding only the prefix and that path."""
    q, keys, values, visible = tree_case(prefix=prefix, heads=heads, kv_heads=kv_heads, d=d)
    together = cpu_kernels.attend(q, keys, values, visible, 0.125)
    prefix = keys.shape[2] - q.shape[0]
    for node, path in enumerate([[0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4]]):
        kept = list(range(prefix)) + [prefix + p for p in path]
        alone = cpu_kernels.attend(q[node : node + 1], keys[:, :, kept], values[:, :, kept], None, 0.125)
        assert torch.equal(together[node], alone[0]), node


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(2, 2, 64), (3, 1, 64), (4, 2, 128)])
def test_attention_takes_any_number_of_readers_in_its_blocks(threads, heads, kv_heads, d):
    """1 to 13 rows under a causal mask, so a key/value head's readers leave every remainder of the
    blocks whose value sums are held together (6 at head size 64, 2 at 128): each row is still grouped-
    query attention, and the same bits as the row attending alone."""
    generator = torch.Generator().manual_seed(11)
    prefix, rows = 21, 13
    q = torch.randn(rows, heads, d, generator=generator)
    keys, values = (torch.randn(1, kv_heads, prefix + rows, d, generator=generator) for _ in "kv")
    visible = torch.ones(rows, prefix + rows, dtype=torch.bool).tril(prefix)
    with torch_threads(threads):
        alone = [
            cpu_kernels.attend(q[i : i + 1], keys, values, visible[i : i + 1], 0.125) for i in range(rows)
        ]
        for n in range(1, rows + 1):
            together = cpu_kernels.attend(q[:n], keys, values, visible[:n], 0.125)
            for i in range(n):
                assert torch.equal(together[i], alone[i][0]), (n, i)
    expected = reference_attention(q, keys, values, visible)
    torch.testing.assert_close(together.double(), expected, rtol=1e-5, atol=1e-6)


def test_exp_gives_each_value_the_same_bits_in_a_vector_or_alone():
    """The softmax's and SiLU's exp: a value's bits do not depend on where it falls in a call (the
    vector loops take blocks, the last few values run one at a time), and it is exp of the shifted
    float32 value within a few ulp."""
    lib = cpu_kernels.library()
    assert lib is not None
    values = torch.empty(1021).uniform_(-95.0, 95.0, generator=torch.Generator().manual_seed(12))
    values[:4] = torch.tensor([0.0, -87.0, 88.0, 0.5])
    together = values.clone()
    lib.specserve_exp_shifted(together.data_ptr(), together.numel(), 1.5)
    alone = values.clone()
    for i in range(alone.numel()):
        lib.specserve_exp_shifted(alone.data_ptr() + 4 * i, 1, 1.5)
    assert torch.equal(together, alone)
    expected = torch.exp((values - 1.5).clamp(-87.0, 88.0).double())
    torch.testing.assert_close(together.double(), expected, rtol=3e-7, atol=0.0)
