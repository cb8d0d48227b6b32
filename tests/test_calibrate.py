"""The switch calibration's fit (examples/rl_loop/calibrate.py): a way's fixed cost, cost per
tensor and byte scale from runs that vary tensors and bytes apart, and what the rates then
predict."""

from __future__ import annotations

import dataclasses

import pytest

from colocate.planning import Rates
from examples.rl_loop.calibrate import fit_disk, fit_switch, median


def test_a_fit_through_runs_gives_the_fixed_cost_the_cost_per_tensor_and_the_byte_scale():
    # a switch that costs 12 ms, 50 us a tensor and twice its bytes' time on one slot, and
    # 3 ms and half its bytes' time more on a second, with 1% noise
    def took(moved: float, tensors: int, noise: float, more: int = 0
             ) -> tuple[float, int, int, float]:
        seconds = 0.012 + 0.003 * more + 50e-6 * tensors + (2.0 + 0.5 * more) * moved
        return moved, tensors, more, seconds * (1 + noise)

    points = [took(0.001, 100, 0.01), took(0.002, 200, -0.01), took(0.030, 200, 0.005),
              took(0.010, 200, -0.005)]
    (fixed, per_tensor, scale), grows = fit_switch(points)
    assert fixed == pytest.approx(0.012, rel=0.1)
    assert per_tensor == pytest.approx(50e-6, rel=0.1)
    assert scale == pytest.approx(2.0, rel=0.05)
    assert grows == (0.0, 0.0, 0.0)  # one slot only: nothing to grow
    both = fit_switch([*points, *(took(m, t, n, more=1) for m, t, n in
                                  [(0.001, 100, 0.0), (0.002, 200, 0.0), (0.030, 200, 0.0)])])
    assert both[0] == pytest.approx((0.012, 50e-6, 2.0), rel=0.1)
    assert both[1][0] == pytest.approx(0.003, rel=0.3)  # the 1-slot points' noise shares it
    assert both[1][2] == pytest.approx(0.5, rel=0.1)
    # the tensors alone would read as bytes: sizes that differ in both cannot tell them
    # apart, and then the whole slope goes to one term, never negative to the other
    assert min(fit_switch([took(0.001, 100, 0), took(0.01, 200, 0)])[0]) >= 0


def test_a_second_slot_measured_faster_somewhere_adds_nothing_there_and_takes_nothing_off():
    # two slots measured as one at the small size, 20% slower at the large one: the growth
    # goes to the bytes, none of it below 0, and the 1-slot fit is the 1-slot points'
    one = [(0.0001, 20, 0, 0.0030), (0.0001, 40, 0, 0.0032), (0.003, 40, 0, 0.0080)]
    two = [(0.0001, 20, 1, 0.0029), (0.0001, 40, 1, 0.0032), (0.003, 40, 1, 0.0096)]
    (fixed, per_tensor, scale), grows = fit_switch(one + two)
    assert min(grows) >= 0 and grows[2] > 0
    for moved, tensors, more, seconds in one + two:
        fitted = (fixed + more * grows[0] + (per_tensor + more * grows[1]) * tensors
                  + (scale + more * grows[2]) * moved)
        assert fitted == pytest.approx(seconds, rel=0.05)


def test_a_way_that_moves_nothing_has_its_fixed_cost_alone():
    (fixed, per_tensor, scale), grows = fit_switch([(0.0, 0, 0, 0.0004), (0.0, 0, 0, 0.0005),
                                                    (0.0, 0, 1, 0.0006)])
    assert (per_tensor, scale) == (0.0, 1.0)
    assert fixed == pytest.approx(0.00045, rel=0.05)  # relative errors: nearer the least
    assert fixed + grows[0] == pytest.approx(0.0006) and grows[1:] == (0.0, 0.0)
    # never below 0: a noisy line that would cross 0 is held there
    assert fit_switch([(0.001, 10, 0, 0.0001), (0.010, 10, 0, 0.0300)])[0][0] == 0.0


def test_what_a_backup_on_disk_adds_is_fitted_per_file_and_per_byte_each_way():
    # 3 ms a stage's file, writes 4x their time, reads 0.5x; beside 20 ms of the rest
    def point(written: float, read: float, stages: int) -> tuple[float, float, int, float,
                                                                  float]:
        left = 0.003 * stages + 4.0 * written + 0.5 * read
        return written, read, stages, left, 0.020 + left

    found = fit_disk([point(0.0005, 0, 1), point(0.030, 0, 1), point(0, 0.001, 1),
                      point(0, 0.040, 2)])
    assert found == pytest.approx((0.003, 4.0, 0.5), rel=0.01)
    assert fit_disk([point(0.001, 0, 1), point(0.02, 0, 1)])[2] is None  # nothing read
    assert fit_disk([]) == (0.0, None, None)  # no run went to disk: the way's scale holds


def test_the_rates_price_a_switch_with_its_ways_fit():
    rates = Rates(device="cpu", backup_out=1e9, backup_in=1e9, drop=1e12, refill=1e12,
                  in_slot=1e9, fixed_s={"wake": 0.01}, fixed_per_slot_s={"wake": 0.002},
                  byte_scale={"wake": 2.0}, byte_scale_per_slot={"wake": 0.5},
                  per_tensor_s={"wake": 1e-4}, per_tensor_per_slot_s={"wake": 1e-5},
                  disk_out=5e8, disk_in=5e8)
    # 10 ms of bytes to host memory and back, 2 ms to disk, 10 tensors
    assert rates.seconds("wake", copied_out=5_000_000, copied_in=5_000_000,
                         to_disk=1_000_000, tensors=10) == pytest.approx(
        0.01 + 10 * 1e-4 + 2.0 * 0.012)
    assert rates.seconds("wake", copied_out=10_000_000, slots=3, tensors=10) == \
        pytest.approx(0.01 + 2 * 0.002 + 10 * (1e-4 + 2 * 1e-5) + (2.0 + 2 * 0.5) * 0.01)
    assert rates.seconds("in_place", in_slot=1_000_000) == pytest.approx(0.001)  # unfitted
    on_disk = dataclasses.replace(rates, disk_stage_s=0.003, disk_out_scale=4.0,
                                  disk_in_scale=0.5)
    assert on_disk.seconds("wake", to_disk=1_000_000, from_disk=2_000_000,
                           disk_stages=2) == pytest.approx(0.01 + 2 * 0.003 + 4.0 * 0.002
                                                           + 0.5 * 0.004)


def test_runs_of_one_configuration_give_the_median_of_their_points():
    # one run in three far off (a backup read back from disk at twice its time): its
    # point is left out, coordinate by coordinate, and the counts stay whole
    runs = [(0.0, 0.0147, 1, 0.0104, 0.0267), (0.0, 0.0147, 1, 0.0099, 0.0262),
            (0.0, 0.0147, 1, 0.0404, 0.0567)]
    assert median(runs) == (0.0, 0.0147, 1, 0.0104, 0.0267)
    assert median([(0.002, 21, 1, 0.003)]) == (0.002, 21, 1, 0.003)
