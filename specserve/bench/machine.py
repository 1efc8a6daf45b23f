"""What the benchmark ran on: recorded next to every result so numbers can be compared honestly."""

from __future__ import annotations

import os
import platform
import socket
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from specserve.settings import EngineSettings


def machine_info(settings: EngineSettings | None = None) -> dict[str, Any]:
    """CPU, cores, threads, RAM, OS, library versions, device/dtype, host and date.

    Call it after the engine has loaded: torch's thread count is only final once the engine has
    applied `settings.num_threads`.
    """
    return {
        "cpu_model": _cpu_model(),
        # "AMD EPYC" names Zen 3 (AVX2) and Zen 4 (AVX-512) alike, whose kernels differ by 2x or more
        "cpu_capability": _cpu_capability(),
        "logical_cores": os.cpu_count(),
        "torch_threads": _torch_threads(),
        "ram_gib": _ram_gib(),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "device": settings.device if settings else None,
        "dtype": settings.dtype if settings else None,
        "weights": settings.resolved_weights if settings else None,
        "hostname": socket.gethostname(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            # x86 says "model name"; some ARM kernels only say "Hardware" or "Processor".
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Hardware", "Processor") and value.strip():
                return value.strip()
    except OSError:
        pass  # not Linux: fall back to what the platform module knows
    return platform.processor() or platform.machine() or "unknown"


def _cpu_capability() -> str | None:
    """The vector instruction set torch's CPU kernels run with here (e.g. AVX2, AVX512); None where
    torch is not loaded (a bench driving a remote stack imports none, and this does not import it)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    return str(torch.backends.cpu.get_cpu_capability())


def _ram_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)  # the value is in KiB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _torch_threads() -> int | None:
    if "torch" not in sys.modules:
        # The real engine has imported torch by now; a fake engine in tests has not, and importing
        # torch only to report a thread count nobody used would be misleading (and slow).
        return None
    return sys.modules["torch"].get_num_threads()


def _version(dist: str) -> str | None:
    # Distribution metadata avoids importing transformers (seconds of import time).
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
