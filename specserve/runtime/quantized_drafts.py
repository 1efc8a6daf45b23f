"""Drafts on rounded weights: a served draft's linear layers rounded per group of 32 inputs to 8 bits
(GGUF's Q8_0) or 4 bits (GGUF's Q4_1), run on the kernels the target's file weights run on (the CPU's
int8-dot kernel; torch's int4 kernel elsewhere for 4 bits).

The draft's precision never touches the output: the target verifies every token, so speculative output
stays the target's own; only how often drafts are accepted moves, against how much a draft step costs.

- 8 bits, for the one-layer drafts (GliDe, hidden-state, vanilla block). A one-layer draft of the default
  model streams 36 MB of float32 weights a step (its LM head alone is 19 MB), more than a third of what
  the target's whole 4-bit step reads, so a draft step cost half a target step. In int8 it reads a
  quarter of that: a step 2.4-2.9 ms -> 0.7-0.9 ms. But beside the file's weights the rounded
  hidden-state draft was accepted less (21% against 23% on chat, 36% against 39% on grounded prompts)
  while the cheaper step let the cost policy draft more of it, and the default method ran slower in both
  workloads (docs/benchmarks.md, "Drafts on int8 weights"): opt-in (`draft_weights=int8`).
- 4 bits, for a separate draft model too. Qwen2.5-Coder-0.5B ships its layers as Q8_0 and Q5_0, which
  run as 8-bit codes: its step cost about half the 1.5B target's, too much for most chains to pay.
  Rounded to 4 bits from its float weights (its embedding and head too), it reads about half the bytes
  (`draft_weights=int4`, the Qwen2.5-Coder-1.5B profile's choice: docs/benchmarks.md, "A 4-bit draft").
  Its rounding is kept in the cache (`rounded_store`), built once.

The formats: Q8_0 with a float32 scale, w ~= q * scale, q = round(w / scale) in [-127, 127], scale =
max |w| / 127; Q4_1, w ~= code * d + m, code = round((w - m) / d) in [0, 15], d = (max - min) / 15 and
m = min, both in fp16 as the file format keeps them; per row and group of 32 inputs. The layers go
through `apply_as_shipped`, so a draft's q/k/v and gate/up become one product each, as the target's do.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specserve.models.default_model import build_once, is_complete
from specserve.models.gguf_quant import GROUP, QuantizedWeight, split_signed, write_store
from specserve.models.loading import load_causal_lm
from specserve.runtime.int4 import apply_as_shipped
from specserve.runtime.measuring import measuring_alone

INT8_SOURCE = "Q8_0"  # the layout the kernel reads (a file's signed 8-bit format)
INT4_SOURCE = "Q4_1"
EMBEDDING_KEY = "model.embed_tokens.weight"


def _groups(weight: torch.Tensor) -> np.ndarray:
    """[N, K] float weight (K a multiple of 32) -> float32 [N, K / 32, 32]."""
    values = weight.detach().float().cpu().numpy()
    n, k = values.shape
    return values.reshape(n, k // GROUP, GROUP)


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """[N, K] float weight (K a multiple of 32) -> its int8 rounding, per row and group of 32 inputs."""
    grouped = _groups(weight)
    scale = np.abs(grouped).max(axis=-1) / 127.0  # [N, K / 32]
    safe = np.where(scale > 0, scale, 1.0)
    q = np.clip(np.rint(grouped / safe[..., None]), -127, 127).astype(np.int8).reshape(weight.shape)
    return split_signed(q, scale.astype(np.float32), GROUP, INT8_SOURCE)


def quantize_int4(weight: torch.Tensor) -> QuantizedWeight:
    """[N, K] float weight (K a multiple of 32) -> its Q4_1 rounding, per row and group of 32 inputs: one
    part of codes 0..15 (gguf_quant's representation: scale d, zero m + 8d)."""
    grouped = _groups(weight)
    low, high = grouped.min(axis=-1), grouped.max(axis=-1)  # [N, K / 32]
    d = ((high - low) / 15.0).astype(np.float16).astype(np.float32)
    m = low.astype(np.float16).astype(np.float32)
    safe = np.where(d > 0, d, 1.0)
    codes = np.clip(np.rint((grouped - m[..., None]) / safe[..., None]), 0, 15).astype(np.uint8)
    codes = codes.reshape(weight.shape)
    return QuantizedWeight(codes[None], d[None], (m + 8.0 * d)[None], GROUP, INT4_SOURCE)


Quantizer = Callable[[torch.Tensor], QuantizedWeight]
QUANTIZERS: dict[str, Quantizer] = {"int8": quantize_int8, "int4": quantize_int4}


def rounded_weights(model: nn.Module, kind: str, embedding: bool = False) -> dict[str, QuantizedWeight]:
    """Every frozen `nn.Linear` of `model` whose inputs come in whole groups, rounded as `kind` says, by
    weight name; with `embedding`, its own token embedding too (a separate draft's: a one-layer draft's
    is the target's, borrowed)."""
    quantize = QUANTIZERS[kind]
    weights = {
        f"{name}.weight": quantize(module.weight)
        for name, module in model.named_modules()
        if type(module) is nn.Linear and not module.weight.requires_grad and module.in_features % GROUP == 0
    }
    table = getattr(getattr(model, "model", None), "embed_tokens", None)
    if embedding and isinstance(table, nn.Embedding) and table.embedding_dim % GROUP == 0:
        weights[EMBEDDING_KEY] = quantize(table.weight)
    return weights


def apply_rounded(model: nn.Module, kind: str) -> int:
    """Replaces a one-layer draft's frozen linear layers (its embedding is the target's, borrowed) by
    their `kind` rounding ("int8" or "int4") on the CPU's int8-dot kernel, or torch's int4 kernel where
    that is what runs 4-bit codes; returns how many modules were replaced."""
    weights = rounded_weights(model, kind)
    if kind == "int8":
        return apply_as_shipped(model, weights, compute_dtype=torch.float32, kernel="int8-dot")
    # torch's int4 kernels read bfloat16 rows; the int8-dot kernel reads float32 whatever is asked
    return apply_as_shipped(model, weights, compute_dtype=torch.bfloat16, kernel="auto")


def rounded_store(model_dir: Path, kind: str, cache_dir: Path) -> Path:
    """A separate draft model's `kind` rounding (its linear layers, embedding and head), as a store that
    `load_causal_lm(..., as_shipped=store)` serves, built once into `cache_dir`: rounding a 0.5B took
    7 s of CPU at every load. Named by the checkpoint's path and its weight files' sizes and times, so a
    changed checkpoint is rounded again. Built under the host's measuring lock (runtime/measuring.py): a
    target measuring its curve beside the rounding would time the rounding's load as its own."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    facts = [str(Path(model_dir).resolve())] + [
        f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files
    ]
    digest = hashlib.sha256("\n".join(facts).encode()).hexdigest()[:12]
    dest = Path(cache_dir) / "models" / f"{Path(model_dir).name}-{digest}.{kind}"
    if is_complete(dest):
        return dest

    def build(out: Path) -> None:
        model = load_causal_lm(Path(model_dir), "cpu", "float32")
        write_store(rounded_weights(model, kind, embedding=True), {"rounded": kind}, out)

    with measuring_alone(Path(cache_dir)):
        return build_once(dest, build, description=dest.name)
