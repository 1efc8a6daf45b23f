"""Where the Ray pipeline test's time goes: runs `tests/specserve/training/test_training_pipeline.py`
(every data stage on a tiny target, 4 training steps, then a resume to 6) and prints its time, then the
phases Ray Train's controller logged for each of its two runs (Ray's latest session directory).
docs/benchmarks.md ("An AVX2-only host", the test suite) quotes:

    python scripts/diagnostics/ray_pipeline_phases.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEST = "tests/specserve/training/test_training_pipeline.py"


def controller_phases(session: Path) -> None:
    """The controller's timed lines of each Ray Train run of `session`, oldest first."""
    logs = sorted(
        (session / "logs" / "train").glob("ray-train-sys-controller-*.log"), key=lambda p: p.stat().st_mtime
    )
    for index, path in enumerate(logs, 1):
        print(f"-- Ray Train run {index}")
        for line in path.read_text().splitlines():
            record = json.loads(line) if line.startswith("{") else {"message": line}
            message = (record.get("message") or "").split("\n", 1)[0]
            if message.startswith(("[Worker Group Initialization]", "Shutting down")):
                print("   ", record.get("asctime", ""), message[:100])


def main() -> None:
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", TEST], check=False)
    print(f"{TEST}: exit {done.returncode}, {time.monotonic() - began:.1f} s in all")
    controller_phases((Path(tempfile.gettempdir()) / "ray" / "session_latest").resolve())


if __name__ == "__main__":
    main()
