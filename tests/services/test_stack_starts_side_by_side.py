"""The local stack starts its services side by side, not one after another (less than half the time on
2 cores: docs/benchmarks.md, "Starting the stack"), checked over the shared stack's real processes
(their start times from /proc)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from specserve.serving.stack import LocalStack

pytestmark = [pytest.mark.distributed, pytest.mark.model]


def started_s(pid: int) -> float:
    """A process's start, in seconds after boot (/proc/<pid>/stat's 22nd field, in clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process start times from /proc")
def test_the_services_were_started_together(shared_stack: LocalStack) -> None:
    starts = {role: started_s(shared_stack.processes[role].pid) for role in shared_stack.roles}
    # One after another, the draft began only once the target served (5 s or more after it).
    assert max(starts.values()) - min(starts.values()) < 2.0, starts
