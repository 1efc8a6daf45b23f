"""Drafts on 8-bit weights: a served draft's linear layers rounded to int8 per group of 32 inputs, run on the
CPU's int8-dot kernel (runtime/cpu_kernels.py), as the target's file weights are.

A one-layer draft of the default model streams 36 MB of float32 weights a step (its LM head alone is 19
MB), more than a third of what the target's whole 4-bit step reads, so a draft step cost half a target
step. In int8 it reads a quarter of that: measured, a step 2.4-2.9 ms -> 0.7-0.9 ms. The draft's
precision never touches the output: the target verifies every token, so speculative output stays the
target's own; only how often drafts are accepted moves. It moved enough to lose: beside the file's
weights the rounded hidden-state draft was accepted less (21% against 23% on chat, 36% against 39% on
grounded prompts) while the cheaper step let the cost policy draft more of it, and the default method
ran slower in both workloads (docs/benchmarks.md, "Drafts on int8 weights"). So it is opt-in
(`draft_weights=int8`), for replicas where memory counts more.

The format is GGUF's Q8_0 with a float32 scale: w ~= q * scale, q = round(w / scale) in [-127, 127],
scale = max |w| / 127 per row and group of 32 inputs. The layers go through `apply_as_shipped`, so a draft's
q/k/v and gate/up become one product each, as the target's do.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from specserve.models.gguf_quant import GROUP, QuantizedWeight, split_signed
from specserve.runtime.int4 import apply_as_shipped

INT8_SOURCE = "Q8_0"  # the layout the kernel reads (a file's signed 8-bit format)


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """[N, K] float weight (K a multiple of 32) -> its int8 rounding, per row and group of 32 inputs."""
    values = weight.detach().float().cpu().numpy()
    n, k = values.shape
    grouped = values.reshape(n, k // GROUP, GROUP)
    scale = np.abs(grouped).max(axis=-1) / 127.0  # [N, K / 32]
    safe = np.where(scale > 0, scale, 1.0)
    q = np.clip(np.rint(grouped / safe[..., None]), -127, 127).astype(np.int8).reshape(n, k)
    return split_signed(q, scale.astype(np.float32), GROUP, INT8_SOURCE)


def int8_weights(model: nn.Module) -> dict[str, QuantizedWeight]:
    """Every frozen `nn.Linear` of `model` whose inputs come in whole groups, quantized, by weight name."""
    return {
        f"{name}.weight": quantize_int8(module.weight)
        for name, module in model.named_modules()
        if type(module) is nn.Linear and not module.weight.requires_grad and module.in_features % GROUP == 0
    }


def apply_int8(model: nn.Module) -> int:
    """Replaces `model`'s frozen linear layers by their int8 form on the int8-dot kernel (CPU); returns how
    many modules were replaced. Its embedding (a draft's is the target's, borrowed) is left alone."""
    return apply_as_shipped(model, int8_weights(model), compute_dtype=torch.float32, kernel="int8-dot")
