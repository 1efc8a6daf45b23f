"""One cost measurement at a time on a host: a second process's measurement waits for the first, and
a target that waited reads the curve the other process recorded instead of measuring again."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from specserve.runtime.measuring import measuring_alone
from specserve.runtime.target_runtime import TargetRuntime
from specserve.settings import EngineSettings

HOLD_S = 1.5


@contextmanager
def held_elsewhere(cache_dir: Path, then_write: Path | None = None) -> Iterator[subprocess.Popen]:
    """Another process holds the lock for HOLD_S seconds (writing `then_write`'s record before it lets
    go, as a measurement would)."""
    record = {"verify_s": {"1": 0.123, "8": 0.456}}
    script = textwrap.dedent(f"""
        import json, sys, time
        from pathlib import Path
        from specserve.runtime.measuring import measuring_alone
        with measuring_alone(Path({str(cache_dir)!r})):
            print("held", flush=True)
            time.sleep({HOLD_S})
            if {then_write is not None}:
                Path({str(then_write)!r}).write_text({json.dumps(json.dumps(record))})
    """)
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == "held"
        yield process
    finally:
        process.wait(30)


def test_a_measurement_waits_for_another_processs(tmp_path: Path, caplog) -> None:
    with held_elsewhere(tmp_path):
        start = time.monotonic()
        with measuring_alone(tmp_path):
            waited = time.monotonic() - start
    assert waited > HOLD_S / 2
    assert "another process on this host is measuring" in caplog.text


def test_nested_measurements_of_one_thread_and_other_directories_do_not_wait(tmp_path: Path) -> None:
    start = time.monotonic()
    with measuring_alone(tmp_path), measuring_alone(tmp_path), measuring_alone(tmp_path / "other"):
        pass
    assert time.monotonic() - start < HOLD_S / 2
    with held_elsewhere(tmp_path / "elsewhere"):
        start = time.monotonic()
        with measuring_alone(tmp_path):
            assert time.monotonic() - start < HOLD_S / 2


@pytest.mark.timeout(120)
def test_a_target_that_waited_reads_the_curve_recorded_meanwhile(tmp_path: Path, tiny_target_dir) -> None:
    calibration = tmp_path / "costs.json"
    settings = EngineSettings.from_env(
        model_dir=tiny_target_dir, cache_dir=tmp_path, calibration_path=calibration
    )
    runtime = TargetRuntime(settings)
    with held_elsewhere(tmp_path, then_write=calibration):
        points = dict(runtime.verify_points)
    assert points == {1: 0.123, 8: 0.456}  # not measured here: the other process's record
    assert json.loads(calibration.read_text())["verify_s"] == {"1": 0.123, "8": 0.456}
