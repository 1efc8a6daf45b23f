"""The candidate kernels for weights as shipped, side by side: milliseconds per product at 1-16 rows.

    .venv/bin/python scripts/int4_kernels.py [--repeats 100]

Shapes are the default model's (SmolLM2-135M: fused q/k/v 960x576, fused gate/up 3072x576, down 576x1536,
the tied head as two 4-bit parts 49152x1152). For each: torch's int4 kernel with its input in bfloat16,
float16 and float32 (the three input types it takes), its int8 kernel (per-row scales only: Q8_0's
per-32 scales do not fit it), this project's int8-dot kernel (runtime/cpu_kernels.py: rows in int8,
one pass over the weights for all rows), and the dense float32 weight packed for oneDNN and in bfloat16
(what the runtime ran before), so the ratios say what each path costs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch

from specserve.runtime import cpu_kernels

SHAPES = {"qkv 960x576": (960, 576), "gate/up 3072x576": (3072, 576), "down 576x1536": (576, 1536)}
HEAD = {"head 49152x1152": (49152, 1152)}
ROWS = (1, 2, 4, 8, 16)


def milliseconds(call: Callable[[], object], repeats: int) -> float:
    for _ in range(5):
        call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats * 1e3


def time_rows(call: Callable[[torch.Tensor], object], x: torch.Tensor, repeats: int) -> float:
    return milliseconds(lambda: call(x), repeats)


def candidates(n: int, k: int) -> dict[str, Callable[[torch.Tensor], object]]:
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    pairs = torch.rand(k // 32, n, 2) * 0.01
    dense = torch.randn(n, k) * 0.05
    onednn = torch.ops.mkldnn._reorder_linear_weight(dense, None)
    int8 = torch.randint(-128, 127, (n, k), dtype=torch.int8)
    row_scales = torch.rand(n) * 0.01

    def int4(dtype: torch.dtype) -> Callable[[torch.Tensor], object]:
        table = pairs.to(dtype)
        return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(dtype), packed, 32, table)

    out = {
        "int4, bf16 input": int4(torch.bfloat16),
        "int4, fp16 input": int4(torch.float16),
        "int4, fp32 input": int4(torch.float32),
        "int8 (per-row scale), bf16": lambda x: torch.ops.aten._weight_int8pack_mm(
            x.bfloat16(), int8, row_scales.bfloat16()
        ),
        "fp32 packed oneDNN": lambda x: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""),
    }
    if cpu_kernels.library() is not None:
        scales = pairs[..., 0].T.contiguous().numpy()
        layout = cpu_kernels.pack(codes.to(torch.uint8).numpy(), scales, np.zeros_like(scales))
        out["int8-dot (this project), fp32"] = lambda x: cpu_kernels.dot_mm(x, layout)
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        bf16 = torch.ops.mkldnn._reorder_linear_weight(dense.bfloat16(), None)
        out["bf16 packed oneDNN"] = lambda x: torch.ops.mkldnn._linear_pointwise(
            x.bfloat16(), bf16, None, "none", [], ""
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()
    capability = torch.backends.cpu.get_cpu_capability()
    print(f"torch {torch.__version__}, {capability}, {torch.get_num_threads()} threads")
    for label, (n, k) in {**SHAPES, **HEAD}.items():
        repeats = max(5, args.repeats // 10) if n > 10_000 else args.repeats
        print(f"\n{label}: ms per product at {', '.join(map(str, ROWS))} rows")
        for name, call in candidates(n, k).items():
            slow = "fp16" in name or "fp32 input" in name
            rows = ROWS[:1] if slow and n > 10_000 else ROWS  # the scalar paths take seconds on the head
            times = [time_rows(call, torch.randn(m, k), repeats if not slow else 3) for m in rows]
            print(f"  {name:28s} " + " ".join(f"{t:8.3f}" for t in times))


if __name__ == "__main__":
    main()
