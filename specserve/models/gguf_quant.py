"""A GGUF file's quantized weights, kept as shipped: every block format decoded into 4-bit codes in groups.

One representation serves every format the model profiles ship, so one kernel runs them all: a weight
[N, K] becomes P parts of 4-bit codes over the same K inputs, each group of `group` inputs with a scale
and a zero point, and

    W[n, k] = sum over parts p of (codes[p][n, k] - 8) * scale[p][n, k // group] + zero[p][n, k // group]

(torch's int4 kernels compute exactly `(code - 8) * scale + zero` per group of 32). The facts per format
(ggml's block layouts):

- Q4_0: 32 values, d (fp16), 4-bit q: `d * (q - 8)`. One part: scale d, zero 0.
- Q4_1: 32 values, d, m (fp16), 4-bit q: `d * q + m`. One part: scale d, zero m + 8d.
- Q4_K: 256 values in 8 groups of 32, d and dmin (fp16), 6-bit sc and m per group: `d*sc * q - dmin*m`.
  One part: scale d*sc, zero 8*d*sc - dmin*m.
- Q8_0 (q in [-128, 127]), Q5_0 (q - 16 in [-16, 15], groups of 32), Q6_K (q - 32 in [-32, 31], groups
  of 16 with an int8 scale times d): a signed integer q = 16*hi + lo with lo in [0, 15] splits into two
  4-bit parts, hi + 8 with scale 16s and zero 0, and lo with scale s and zero 8s. Their sum is s * q.

A kernel that reads groups of 32 takes a group of 16 (Q6_K) as a group of 32 whose second half has zero
input: `widen_input` lays the input out to match. Nothing is requantized: every value above is the file's.
Numpy only (no torch): the install and the tests read files with it.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GROUP = 32  # the kernel's group size; a format with groups of 16 is padded to it
STORE_FILE = "as-shipped.safetensors"
# 2: the K-quants' block scales are kept (`BlockScales`); a store of an older version is rebuilt.
STORE_VERSION = 2
_QK_K = 256


@dataclass(frozen=True)
class BlockScales:
    """A K-quant's scales as its file holds them: a float per superblock of 256 inputs times a small
    integer per group. Q4_K: scale = d * sc and the weight is code * scale - dmin * m; Q6_K: scale =
    d * sc. Each product is exact in float32 (an fp16 times an integer of at most 8 bits), so these
    give the float scales bit for bit, in a quarter of their bytes or less."""

    d: np.ndarray  # float32 [N, K // 256]
    sc: np.ndarray  # int8 [N, K // group]
    dmin: np.ndarray | None = None  # float32 [N, K // 256] (Q4_K)
    m: np.ndarray | None = None  # int8 [N, K // group] (Q4_K)

    def arrays(self) -> dict[str, np.ndarray]:
        return {
            name: getattr(self, name) for name in ("d", "sc", "dmin", "m") if getattr(self, name) is not None
        }

    def rows(self, order: np.ndarray) -> BlockScales:
        return BlockScales(**{name: value[order] for name, value in self.arrays().items()})


@dataclass(frozen=True)
class QuantizedWeight:
    """One weight [N, K] as P parts of 4-bit codes (numpy arrays; see the module docstring).

    codes: uint8 [P, N, K] in 0..15; scales, zeros: float32 [P, N, K // group]; group: 16 or 32;
    source: the GGUF type it came from (Q4_1, Q8_0, ...); block: a K-quant's scales as the file holds
    them (the same values as `scales`), where known.
    """

    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray
    group: int
    source: str
    block: BlockScales | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[1]), int(self.codes.shape[2])

    def dequantize(self) -> np.ndarray:
        """[N, K] float32, the values the kernel multiplies by."""
        parts, n, k = self.codes.shape
        codes = self.codes.reshape(parts, n, k // self.group, self.group).astype(np.float32)
        values = (codes - 8.0) * self.scales[..., None] + self.zeros[..., None]  # [P, N, G, group]
        return values.sum(axis=0).reshape(n, k)

    def signed(self) -> tuple[np.ndarray, np.ndarray] | None:
        """A signed integer format's own integers q int8 [N, K] and scales [N, K // group] (the weight is
        q * scale), recovered from its two parts; None for the 4-bit formats."""
        if self.source not in SIGNED_FORMATS or self.codes.shape[0] != 2:
            return None
        (high_scale, scale), (high_zero, zero) = self.scales, self.zeros
        split = np.array_equal(high_scale, 16 * scale) and np.array_equal(zero, 8 * scale)
        if not split or high_zero.any():
            return None  # not two parts as `split_signed` makes them
        hi, lo = self.codes.astype(np.int16)
        return (16 * (hi - 8) + lo).astype(np.int8), self.scales[1]

    def rows(self, order: np.ndarray) -> QuantizedWeight:
        """The same weight with its output rows reordered (a permutation along N)."""
        block = None if self.block is None else self.block.rows(order)
        return QuantizedWeight(
            self.codes[:, order], self.scales[:, order], self.zeros[:, order], self.group, self.source, block
        )


def _f16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> [...] float32 (little-endian fp16, as ggml stores it)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] packed bytes -> [..., 32] 4-bit values: low nibbles are values 0..15, high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def split_signed(
    q: np.ndarray, scale: np.ndarray, group: int, source: str, block: BlockScales | None = None
) -> QuantizedWeight:
    """A signed integer weight q [N, K] in [-128, 127] with per-group scale [N, K // group] -> two parts."""
    lo = (q & 0x0F).astype(np.uint8)  # two's complement: q = 16 * (q >> 4) + (q & 15)
    hi = ((q >> 4) + 8).astype(np.uint8)
    zeros = np.zeros_like(scale)
    return QuantizedWeight(
        codes=np.stack([hi, lo]),
        scales=np.stack([scale * 16.0, scale]).astype(np.float32),
        zeros=np.stack([zeros, scale * 8.0]).astype(np.float32),
        group=group,
        source=source,
        block=block,
    )


def _q4_0(blocks: np.ndarray, n: int, k: int) -> QuantizedWeight:
    d = _f16(blocks[..., 0:2])  # [N, B]
    q = _nibbles(blocks[..., 2:18]).reshape(n, k)
    return QuantizedWeight(q[None], d[None], np.zeros_like(d)[None], GROUP, "Q4_0")


def _q4_1(blocks: np.ndarray, n: int, k: int) -> QuantizedWeight:
    d, m = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # [N, B] each
    q = _nibbles(blocks[..., 4:20]).reshape(n, k)
    return QuantizedWeight(q[None], d[None], (m + 8.0 * d)[None], GROUP, "Q4_1")


def _q8_0(blocks: np.ndarray, n: int, k: int) -> QuantizedWeight:
    d = _f16(blocks[..., 0:2])
    q = np.ascontiguousarray(blocks[..., 2:34]).view(np.int8).reshape(n, k).astype(np.int16)
    return split_signed(q, d, GROUP, "Q8_0")


def _q5_0(blocks: np.ndarray, n: int, k: int) -> QuantizedWeight:
    d = _f16(blocks[..., 0:2])
    qh = np.ascontiguousarray(blocks[..., 2:6]).view("<u4")  # [N, B, 1]: bit j = high bit of value j
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16)  # [N, B, 32]
    q = _nibbles(blocks[..., 6:22]).astype(np.int16) | (high << 4)
    return split_signed((q - 16).reshape(n, k), d, GROUP, "Q5_0")


def _q4_k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., 12] packed 6-bit scales and mins of 8 groups -> ([..., 8], [..., 8]) as float32."""
    s = scales.astype(np.int32)
    low_sc, low_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    high_sc = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    high_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    sc = np.concatenate([low_sc, high_sc], axis=-1).astype(np.float32)
    m = np.concatenate([low_m, high_m], axis=-1).astype(np.float32)
    return sc, m


def _q4_k(blocks: np.ndarray, n: int, k: int) -> QuantizedWeight:
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # [N, B]
    sc, m = _q4_k_scales(blocks[..., 4:16])  # [N, B, 8]
    qs = blocks[..., 16:144].reshape(n, -1, 4, 32)  # 4 chunks of 32 bytes: groups 2j (low) and 2j+1 (high)
    q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, k)
    scale = (d[..., None] * sc).reshape(n, -1)  # [N, K // 32]
    zero = (8.0 * d[..., None] * sc - dmin[..., None] * m).reshape(n, -1)
    block = BlockScales(d, sc.reshape(n, -1).astype(np.int8), dmin, m.reshape(n, -1).astype(np.int8))
    return QuantizedWeight(q[None], scale[None], zero[None], GROUP, "Q4_K", block)


def _q6_k(blocks: np.ndarray, n: int, k: int) -> QuantizedWeight:
    ql, qh = blocks[..., 0:128], blocks[..., 128:192]
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)  # [N, B, 16]
    d = _f16(blocks[..., 208:210])  # [N, B]
    # Two halves of 128 values: ql's 64 bytes give the low nibbles of 4 runs of 32 (bytes 0-31 low, 32-63
    # low, 0-31 high, 32-63 high), qh's 32 bytes their 2-bit high parts at shifts 0, 2, 4, 6.
    low_shifts = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1, 1)
    low = ((ql.reshape(n, -1, 2, 1, 2, 32) >> low_shifts) & 0x0F).reshape(n, -1, 2, 4, 32)
    high_shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    high = ((qh.reshape(n, -1, 2, 1, 32) >> high_shifts) & 0x03).reshape(n, -1, 2, 4, 32)
    q = (low.astype(np.int16) | (high.astype(np.int16) << 4)) - 32
    scale = (d[..., None] * sc).reshape(n, -1)  # [N, K // 16]
    block = BlockScales(d, sc.reshape(n, -1).astype(np.int8))
    return split_signed(q.reshape(n, k), scale, 16, "Q6_K", block)


# GGUF type name -> (bytes per block, values per block, decoder)
_FORMATS = {
    "Q4_0": (18, 32, _q4_0),
    "Q4_1": (20, 32, _q4_1),
    "Q8_0": (34, 32, _q8_0),
    "Q5_0": (22, 32, _q5_0),
    "Q4_K": (144, _QK_K, _q4_k),
    "Q6_K": (210, _QK_K, _q6_k),
}
SUPPORTED_FORMATS = frozenset(_FORMATS)
SIGNED_FORMATS = frozenset({"Q8_0", "Q5_0", "Q6_K"})  # split into two parts by `split_signed`


def decode(type_name: str, data: np.ndarray, n: int, k: int) -> QuantizedWeight:
    """GGUF tensor bytes [N, bytes per row] of a weight [N, K] -> its parts. KeyError for other types."""
    block_bytes, block_values, decoder = _FORMATS[type_name]
    if k % block_values:
        raise ValueError(f"a {type_name} row of {k} values is not whole blocks of {block_values}")
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(n, k // block_values, block_bytes)
    return decoder(blocks, n, k)


# GGUF tensor names (Llama-family layouts) -> the Hugging Face parameter they hold.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for names not mapped."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    return None


def rotary_row_order(rows: int, heads: int) -> np.ndarray:
    """The row permutation that undoes llama.cpp's interleaving of Llama's q/k rows for its rotary (per
    head, rows (i, i + half) are stored as (2i, 2i + 1)): HF row r takes GGUF row order[r]."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)


def read_gguf(path: Path) -> tuple[dict[str, QuantizedWeight], dict[str, int | str]]:
    """Every quantized weight of a Llama-family GGUF file, under its Hugging Face name, and the facts the
    file states (architecture, heads). Llama's q/k rows are put back in Hugging Face's order."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    heads = int(reader.fields[f"{arch}.attention.head_count"].parts[-1][0])
    kv_heads = int(reader.fields[f"{arch}.attention.head_count_kv"].parts[-1][0])
    weights: dict[str, QuantizedWeight] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        type_name = tensor.tensor_type.name
        if name is None or type_name not in _FORMATS:
            continue  # norms, biases and float tensors stay with the dense checkpoint
        k, n = (int(x) for x in tensor.shape[:2])  # ggml order: ne0 = inputs, ne1 = outputs
        weight = decode(type_name, np.asarray(tensor.data), n, k)
        if arch == "llama" and ".q_proj." in name:
            weight = weight.rows(rotary_row_order(n, heads))
        elif arch == "llama" and ".k_proj." in name:
            weight = weight.rows(rotary_row_order(n, kv_heads))
        weights[name] = weight
    return weights, {"architecture": arch, "heads": heads, "kv_heads": kv_heads}


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """[..., K] values 0..15 -> [..., K // 2] bytes, value 2i in the low nibble and 2i + 1 in the high."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """Inverse of `pack_nibbles`."""
    out = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=np.uint8)
    out[..., 0::2], out[..., 1::2] = packed & 0x0F, packed >> 4
    return out


def write_store(weights: dict[str, QuantizedWeight], facts: dict[str, int | str], out_dir: Path) -> Path:
    """Saves the parts as safetensors (codes nibble-packed: the file's own 4 bits per value)."""
    from safetensors.numpy import save_file

    tensors: dict[str, np.ndarray] = {}
    layout: dict[str, dict[str, int | str]] = {}
    for name, weight in weights.items():
        tensors[f"{name}.codes"] = pack_nibbles(weight.codes)
        tensors[f"{name}.scales"] = np.ascontiguousarray(weight.scales)
        tensors[f"{name}.zeros"] = np.ascontiguousarray(weight.zeros)
        layout[name] = {"group": weight.group, "source": weight.source}
        if weight.block is not None:
            for part, array in weight.block.arrays().items():
                tensors[f"{name}.block.{part}"] = np.ascontiguousarray(array)
    path = Path(out_dir) / STORE_FILE
    metadata = {"layout": json.dumps(layout), "facts": json.dumps(facts), "version": str(STORE_VERSION)}
    save_file(tensors, str(path), metadata=metadata)
    return path


def read_store(path: Path, names: Collection[str] | None = None) -> dict[str, QuantizedWeight]:
    """The weights `write_store` saved: all, or those of `names` it holds."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        layout = json.loads((f.metadata() or {})["layout"])
        if names is not None:
            layout = {name: info for name, info in layout.items() if name in names}
        keys = set(f.keys())

        def block(name: str) -> BlockScales | None:
            parts = {
                p: f.get_tensor(f"{name}.block.{p}")
                for p in ("d", "sc", "dmin", "m")
                if f"{name}.block.{p}" in keys
            }
            return BlockScales(**parts) if parts else None

        return {
            name: QuantizedWeight(
                codes=unpack_nibbles(f.get_tensor(f"{name}.codes")),
                scales=f.get_tensor(f"{name}.scales"),
                zeros=f.get_tensor(f"{name}.zeros"),
                group=int(info["group"]),
                source=str(info["source"]),
                block=block(name),
            )
            for name, info in layout.items()
        }


def store_version(path: Path) -> int:
    """The format version of a store `write_store` saved (1: before the version was written; 0: not a
    store that can be read, to be built again)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            return int((f.metadata() or {}).get("version", 1))
    except (OSError, SafetensorError, ValueError):
        return 0


def convert_store(gguf_path: Path, out_dir: Path) -> None:
    """GGUF file -> `out_dir/as-shipped.safetensors` (a builder for `build_once`)."""
    weights, facts = read_gguf(Path(gguf_path))
    write_store(weights, facts, out_dir)
