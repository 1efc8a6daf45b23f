"""Calibration timing: every size is measured across the whole run, so drift cannot bend the curve."""

from __future__ import annotations

import logging

import pytest
import torch
from tiny_llama import tiny_llama

from specserve.runtime.calibrate import (
    ProgressLog,
    interleaved_best,
    measure_batch_verify_s,
    measure_verify_s,
    time_by_size,
)
from specserve.runtime.runner import ModelRunner


class DriftingHost:
    """A fake clock where a call costs its size in units, times a slowdown that halves halfway through
    the run (a noisy neighbour leaving): what a shared host's memory bandwidth does to a calibration."""

    def __init__(self, total_calls: int) -> None:
        self.now, self.calls, self.total_calls = 0.0, 0, total_calls

    def call(self, size: float):
        def run() -> None:
            slowdown = 2.0 if self.calls < self.total_calls // 2 else 1.0
            self.now += size * slowdown
            self.calls += 1

        return run

    def clock(self) -> float:
        return self.now


def test_a_slow_first_half_of_the_run_does_not_land_on_the_first_sizes():
    sizes = [1.0, 1.2, 1.5, 3.0]
    passes = 3
    host = DriftingHost(total_calls=len(sizes) * (passes + 1))
    seconds = interleaved_best([host.call(s) for s in sizes], passes, clock=host.clock)
    # Every size met the fast half: the measured curve is the true one, in order. Measured size by size,
    # the first sizes would have taken only slow calls and read 2.0 and 2.4: above the 1.5 of size three.
    assert seconds == pytest.approx(sizes)


class HangoverHost:
    """A fake clock where a call costs its size, plus half of what a larger call just before it exceeded
    it by: a forward right after a larger one runs slow, as an Intel Xeon's did (the cores' clocks or
    the weights' cache lines recovering)."""

    def __init__(self) -> None:
        self.now, self.previous = 0.0, 0.0

    def call(self, size: float):
        def run() -> None:
            self.now += size + 0.5 * max(0.0, self.previous - size)
            self.previous = size

        return run

    def clock(self) -> float:
        return self.now


def test_each_size_is_timed_after_its_own_calls_not_after_a_larger_one():
    sizes = [1, 2, 4, 8, 64]
    host = HangoverHost()
    seconds = time_by_size(sizes, [host.call(s) for s in sizes], 2, "timing", clock=host.clock)
    # Timed in order from one token up, the one-token call always followed the 64-token one and read
    # 32.5: the curve flat, every tree looking cheap against a step.
    assert seconds == ((1, 1.0), (2, 2.0), (4, 4.0), (8, 8.0), (64, 64.0))


def test_settling_calls_are_untimed_and_counted_for_progress():
    host = HangoverHost()
    calls = []
    seconds = interleaved_best(
        [host.call(3.0), host.call(1.0)],
        passes=2,
        clock=host.clock,
        on_call=lambda: calls.append(1),
        settle=1,
    )
    assert seconds == [3.0, 1.0] and len(calls) == 2 * (1 + 2 * 2)


def test_each_call_is_counted_once_for_progress():
    calls = []
    interleaved_best([lambda: None, lambda: None], passes=2, on_call=lambda: calls.append(1))
    assert len(calls) == 2 * (2 + 1)  # a warm-up pass and two timed passes


def test_a_tiny_models_curves_cover_every_size():
    runner = ModelRunner(tiny_llama())
    with torch.inference_mode():
        verify = measure_verify_s(runner, sizes=(1, 2, 5), prompt_tokens=8, repeats=1)
        batched = measure_batch_verify_s(runner, totals=(16, 32), prompt_tokens=8, repeats=1)
    assert [n for n, _ in verify] == [1, 2, 5] and [n for n, _ in batched] == [16, 32]
    assert all(seconds > 0 for _, seconds in (*verify, *batched))


def test_progress_is_logged_at_most_every_interval_and_at_the_end(caplog):
    now = [0.0]
    progress = ProgressLog("measuring", total=6, every=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="specserve.runtime.calibrate"):
        for seconds in (3.0, 4.0, 4.0, 2.0, 12.0, 1.0):  # logs at 11 s (3 done), 25 s (5) and the end (6)
            now[0] += seconds
            progress.update()
    assert [r.getMessage() for r in caplog.records] == [
        "measuring: 3 / 6 forwards",
        "measuring: 5 / 6 forwards",
        "measuring: 6 / 6 forwards",
    ]
