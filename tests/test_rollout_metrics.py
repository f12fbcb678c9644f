"""Rollout records' groups in flight: the most at once and the mean over the window's time, worked out by
hand on a clock the test moves (a window's level carries over into the next)."""

import pytest

from molt_hpc.rollout import metrics
from molt_hpc.rollout.metrics import RolloutStats


def test_in_flight_mean_is_time_weighted_and_carries_over(monkeypatch) -> None:
    now = [100.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: now[0])
    stats = RolloutStats()
    for t, n in ((101.0, 4), (103.0, 2)):  # none for 1 s, 4 groups for 2 s, 2 groups for 1 s
        now[0] = t
        stats.in_flight(n)
    now[0] = 104.0
    first = stats.record()
    assert first["in_flight_mean"] == pytest.approx((0 * 1 + 4 * 2 + 2 * 1) / 4)
    assert first["in_flight_max"] == 4 and first["window_s"] == 4.0
    now[0] = 106.0
    stats.in_flight(0)  # the 2 groups of the last window stayed 2 s into this one
    now[0] = 108.0
    second = stats.record()
    assert second["in_flight_mean"] == pytest.approx((2 * 2 + 0 * 2) / 4)
    assert second["in_flight_max"] == 2  # the level the window started at counts as held
    now[0] = 110.0
    assert stats.record()["in_flight_mean"] == 0.0 and stats.totals["groups_finished"] == 0
