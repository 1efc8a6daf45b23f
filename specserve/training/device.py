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
    """What a run's records say about its device: the name, and on a GPU which one."""
    if device.type == "cuda":
        return {"device": str(device), "gpu": torch.cuda.get_device_name(device)}
    return {"device": str(device)}


def to_device(batch: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of a batch on `device`; tensors already there are kept as they are (no copy)."""
    return {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}


def bf16_autocast(device: torch.device, enabled: bool) -> AbstractContextManager[Any]:
    """bfloat16 autocast for `device`'s type (CPU and CUDA alike), or nothing when not `enabled`."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if enabled else nullcontext()
