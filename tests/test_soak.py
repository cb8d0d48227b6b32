"""bench/soak.py's pure helpers: message counts between the counter's readings, the two
windows, and the RSS verdict net of the echo baseline."""

from __future__ import annotations

import pytest

from bench.soak import MIB, judge_rss, messages_at, windows


def test_messages_at_is_exact_at_a_reading_and_linear_between():
    readings = [(20, 162), (100, 1450), (120, 1770)]
    assert messages_at(readings, 20) == 162
    assert messages_at(readings, 100) == 1450
    assert messages_at(readings, 60) == pytest.approx(806)
    assert messages_at(readings, 110.5) == pytest.approx(1618)


@pytest.mark.parametrize("step", [19, 120.5])
def test_messages_at_refuses_steps_outside_the_readings(step):
    with pytest.raises(ValueError, match="outside the readings"):
        messages_at([(20, 162), (120, 1770)], step)


def test_windows_are_the_steps_after_the_warmup_and_the_last_steps():
    assert windows(20, 100, 2000) == (range(20, 120), range(1900, 2000))


def test_judge_rss_judges_the_growth_less_the_echo_baseline():
    early, late = windows(2, 3, 10)
    grown = {s: (100 + (20 if s >= 7 else 0)) * MIB for s in range(10)}  # +20 MiB
    series = {"pid 7 weights": {"pid": 7, "tag": "weights", "by_step": grown},
              "pid 8 weights": {"pid": 8, "tag": "weights", "by_step": grown}}
    baselines = {7: {"growth": 15 * MIB}, 8: {"growth": 3 * MIB}}
    rows = judge_rss(series, early, late, 16 * MIB, baselines)
    assert [(r["growth_mib"], r["baseline_mib"], r["net_mib"], r["ok"]) for r in rows] == [
        (20, 15, 5, True), (20, 3, 17, False)]
