"""The load a service reports: sessions seen lately, or a larger load a caller reports."""

from __future__ import annotations

import time

from specserve.serving.recent import RecentSessions


def test_sessions_count_until_the_horizon_passes() -> None:
    recent = RecentSessions(horizon_seconds=0.2)
    recent.touch("a")
    recent.touch("b")
    assert recent.count() == 2
    recent.forget("a")
    assert recent.count() == 1
    time.sleep(0.25)
    assert recent.count() == 0


def test_a_reported_load_counts_when_larger_and_expires_with_its_session() -> None:
    recent = RecentSessions(horizon_seconds=0.2)
    recent.touch("a", reported_load=12)
    recent.touch("b", reported_load=3)
    assert recent.count() == 12
    time.sleep(0.25)
    recent.touch("b", reported_load=3)
    assert recent.count() == 3
