"""A local Ray start that does not come up is torn down and retried, and the error says why."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specserve.training.data import RayStartError, init_ray

pytestmark = pytest.mark.ray


def processes_of(sessions: list[str]) -> list[str]:
    """The command lines of live processes started for any of these Ray sessions."""
    found = []
    for pid_dir in Path("/proc").iterdir():
        if pid_dir.name.isdigit():
            try:
                cmdline = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if any(session in cmdline for session in sessions):
                found.append(cmdline)
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads live processes from /proc")
def test_a_start_that_never_comes_up_is_retried_then_named_and_leaves_nothing_running(monkeypatch):
    ray = pytest.importorskip("ray")
    assert not ray.is_initialized()
    # Ray's own operator override: no time at all for the GCS server to bind, so every start times out
    monkeypatch.setenv("RAY_gcs_server_port_wait_time_s", "0")
    with pytest.raises(RayStartError, match="did not start in 2 attempts") as failed:
        init_ray(num_cpus=1, attempts=2)
    sessions = re.findall(r"session_[0-9_-]+", str(failed.value))
    assert len(set(sessions)) == 2  # two fresh starts, each named with what its GCS server logged
    assert str(failed.value).count("GCS") >= 2
    assert not ray.is_initialized()
    assert processes_of(sessions) == []  # the half-started servers were stopped, not left behind
