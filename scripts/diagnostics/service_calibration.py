"""The verify curve a target service measures at start-up, beside the same curve measured in a plain
process, one after the other on this host (the cost policy sizes every tree by the published one).

    python scripts/diagnostics/service_calibration.py [--model NAME]

The service runs as a local stack's target with a calibration file of its own (so it measures), and is
stopped once SERVING; then this process measures the same model. Prints milliseconds per size.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from specserve.serving.stack import LocalStack
from specserve.settings import EngineSettings

SIZES = ("1", "2", "4", "8", "16")


def in_service(model: str | None, out: Path) -> dict[str, float]:
    """A local stack of the target alone (and its Redis), stopped once it serves: its start-up record."""
    env = {"SPECSERVE_CALIBRATION_PATH": str(out)} | ({"SPECSERVE_MODEL": model} if model else {})
    with LocalStack(log_dir=out.parent / "stack", env=env, roles=("target",)):
        pass
    return json.loads(out.read_text())["verify_s"]


def in_process(model: str | None, out: Path) -> dict[str, float]:
    from specserve.runtime.target_runtime import TargetRuntime

    overrides = {"SPECSERVE_MODEL": model} if model else {}
    runtime = TargetRuntime(EngineSettings.from_env(os.environ | overrides, calibration_path=out))
    return {str(n): s for n, s in runtime.verify_points}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model profile (default: the default model)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        started = time.time()
        service = in_service(args.model, Path(directory) / "service.json")
        plain = in_process(args.model, Path(directory) / "plain.json")
    print("verify size | service (ms) | plain process (ms)")
    for size in SIZES:
        print(f"{size:>11} | {service[size] * 1e3:12.2f} | {plain[size] * 1e3:18.2f}")
    print(f"({time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
