"""Where the training pipeline's tensors live: "cpu" (the default, a complete path) or a CUDA GPU.

Each command (generation, features, training) takes one device name, and `usable_device` checks it
before anything loads or is written, so a GPU this machine lacks is one clear error rather than a
failure deep inside torch. The models load on that device and every other tensor follows them: batches
are built on the CPU (from numpy, where the data is) and moved in one step, index and mask tensors are
made on the device of the tensors they meet, and whatever is written to disk is copied back first.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from specserve.errors import FailedPrecondition, InvalidArgument, quoted

DEVICE_TYPES = ("cpu", "cuda")


def parse_device(name: str) -> torch.device:
    """A device name, "cpu", "cuda" or "cuda:N", as a torch device; InvalidArgument for any other."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in DEVICE_TYPES:
        raise InvalidArgument(f"device must be cpu, cuda or cuda:N, got {quoted(name)}")
    return device


def usable_device(name: str) -> torch.device:
    """`parse_device`, and FailedPrecondition unless this process can run on it."""
    device = parse_device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise FailedPrecondition(
            f"device {name}: torch sees no CUDA GPU in this process (torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda or 'no'}); run with --device cpu"
        )
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise FailedPrecondition(f"device {name}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return device


def device_record(device: torch.device) -> dict[str, str]:
    """What a run's records say about its device: the name, on a GPU which one, on a CPU whether it
    runs bf16 autocast (not on a CPU without a bf16 kernel: `bf16_autocast`)."""
    if device.type == "cuda":
        return {"device": str(device), "gpu": torch.cuda.get_device_name(device)}
    return {"device": str(device), "cpu_bf16_autocast": "yes" if fast_bf16(device) else "no, float32"}


def to_device(batch: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of a batch on `device`; tensors already there are kept as they are (no copy)."""
    return {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}


def fast_bf16(device: torch.device | str) -> bool:
    """Whether bf16 autocast speeds `device` up: on a GPU, and on a CPU whose oneDNN has a bf16 path
    (AVX-512 or AVX-NE-CONVERT). On an AVX2-only CPU (AMD Zen 3) torch emulates bf16, about 4x slower
    than float32, and the master weights are float32 anyway."""
    from specserve.runtime.kernels import speed_dtype

    return speed_dtype("bfloat16", device) == "bfloat16"


def bf16_autocast(device: torch.device, enabled: bool) -> AbstractContextManager[Any]:
    """bfloat16 autocast for `device`'s type (CPU and CUDA alike) where it is fast (`fast_bf16`), or
    nothing: when not `enabled`, and on a CPU without a bf16 kernel, the step runs in float32."""
    if enabled and fast_bf16(device):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()
