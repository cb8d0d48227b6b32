"""The switch calibration's fit (examples/rl_loop/calibrate.py): a way's fixed cost and byte
scale from runs that move few bytes and many, and what the rates then predict."""

from __future__ import annotations

import pytest

from colocate.planning import Rates
from examples.rl_loop.calibrate import fit_line


def test_a_line_through_runs_gives_the_fixed_cost_and_the_byte_scale():
    # a switch that costs 12 ms plus twice its bytes' time at the raw rates, with noise
    points = [(0.001, 0.0141), (0.010, 0.0322), (0.030, 0.0718), (0.002, 0.0158)]
    fixed, scale = fit_line(points)
    assert fixed == pytest.approx(0.012, abs=0.0005)
    assert scale == pytest.approx(2.0, abs=0.05)
    # a way that moves nothing: no scale to fit, its fixed cost the median time
    assert fit_line([(0.0, 0.0004), (0.0, 0.0005), (0.0, 0.0009)]) == (0.0005, 1.0)
    # never below 0: a noisy line that would cross 0 is held there
    assert fit_line([(0.001, 0.0001), (0.010, 0.0300)])[0] == 0.0


def test_the_rates_price_a_switch_with_its_ways_fit():
    rates = Rates(device="cpu", backup_out=1e9, backup_in=1e9, drop=1e12, refill=1e12,
                  in_slot=1e9, fixed_s={"wake": 0.01}, fixed_per_slot_s={"wake": 0.002},
                  byte_scale={"wake": 2.0}, byte_scale_per_slot={"wake": 0.5},
                  disk_out=5e8, disk_in=5e8)
    # 10 ms of bytes to host memory and back, 2 ms to disk
    assert rates.seconds("wake", copied_out=5_000_000, copied_in=5_000_000,
                         to_disk=1_000_000) == pytest.approx(0.01 + 2.0 * 0.012)
    assert rates.seconds("wake", copied_out=10_000_000, slots=3) == pytest.approx(
        0.01 + 2 * 0.002 + (2.0 + 2 * 0.5) * 0.01)
    assert rates.seconds("in_place", in_slot=1_000_000) == pytest.approx(0.001)  # unfitted
