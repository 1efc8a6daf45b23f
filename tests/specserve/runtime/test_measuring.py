"""One cost measurement at a time on a host, and none while a service starts: a second process's
measurement waits for the first and for a starting service, a service starting meanwhile waits for the
measurement, services start side by side, and a target that waited reads the curve the other process
recorded instead of measuring again."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest

from specserve.runtime.measuring import measuring_alone, starting_up
from specserve.runtime.target_runtime import TargetRuntime
from specserve.settings import EngineSettings

HOLD_S = 1.5


@contextmanager
def held_elsewhere(
    cache_dir: Path, then_write: Path | None = None, how: str = "measuring_alone"
) -> Iterator[subprocess.Popen]:
    """Another process holds the lock for HOLD_S seconds, measuring (`measuring_alone`, writing
    `then_write`'s record before it lets go, as a measurement would) or starting (`starting_up`)."""
    record = {"verify_s": {"1": 0.123, "8": 0.456}}
    script = textwrap.dedent(f"""
        import json, sys, time
        from pathlib import Path
        from specserve.runtime.measuring import {how}
        with {how}(Path({str(cache_dir)!r})):
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


def waited_to_enter(context: AbstractContextManager[None]) -> float:
    """Seconds until `context` was entered (it is left at once)."""
    start = time.monotonic()
    with context:
        return time.monotonic() - start


@pytest.mark.parametrize("elsewhere", ["measuring_alone", "starting_up"])
def test_a_measurement_waits_for_another_processs_measurement_or_start(
    tmp_path: Path, caplog, elsewhere: str
) -> None:
    with held_elsewhere(tmp_path, how=elsewhere):
        assert waited_to_enter(measuring_alone(tmp_path)) > HOLD_S / 2
    assert "waiting for the other services' starts and cost measurements" in caplog.text


def test_a_start_waits_for_a_measurement_and_starts_run_side_by_side(tmp_path: Path, caplog) -> None:
    with held_elsewhere(tmp_path):
        assert waited_to_enter(starting_up(tmp_path)) > HOLD_S / 2
    assert "waiting for another process's cost measurement" in caplog.text
    with held_elsewhere(tmp_path, how="starting_up"):
        assert waited_to_enter(starting_up(tmp_path)) < HOLD_S / 2


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


def test_a_starting_service_measures_once_the_others_started_and_holds_its_start_again(
    tmp_path: Path,
) -> None:
    """Two starting services that both measure would wait for each other if a measurement kept its own
    shared hold: it gives it up while it waits, and takes it back until its start ends."""
    with starting_up(tmp_path):
        with held_elsewhere(tmp_path, how="starting_up"):
            assert waited_to_enter(measuring_alone(tmp_path)) > HOLD_S / 2
        measuring = subprocess.Popen(
            [sys.executable, "-c", MEASURE_THEN_SAY.format(cache_dir=str(tmp_path))],
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(HOLD_S)
        assert measuring.poll() is None  # still waiting: this service has not finished starting
    assert measuring.communicate(timeout=30)[0].strip() == "measured"


MEASURE_THEN_SAY = """
from pathlib import Path
from specserve.runtime.measuring import measuring_alone
with measuring_alone(Path({cache_dir!r})):
    print("measured", flush=True)
"""


def test_a_start_where_the_lock_cannot_be_made_goes_on_without_it(tmp_path: Path, caplog) -> None:
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    with starting_up(not_a_directory / "cache"):
        pass
    assert "starting without the host's measuring lock" in caplog.text
