"""The chaos bench's test-sized mode: faults of different kinds injected into short runs
at seeded moments; each run goes on by itself (or stops naming the cause and is finished
by run.resume=auto), ends with the per-step metrics of the run never faulted, and leaves
no proc and no /dev/shm file behind (`bench/chaos.py`)."""

from __future__ import annotations

import json

import pytest

from bench import chaos

pytestmark = pytest.mark.timeout(600)


def test_the_plan_spreads_the_kinds_and_is_seeded():
    args = chaos.parse(["--faults", "9", "--steps", "40", "--seed", "3"])
    first, again = chaos.plan(args), chaos.plan(args)
    kinds = sorted(f.kind for faults in first.values() for f in faults)
    assert kinds == sorted(chaos.MENU[:9])  # 9 faults: each kind of the menu once, the
    # first 9 (the kinds are taken in the menu's order, then shuffled)
    assert [(f.kind, f.step) for fs in first.values() for f in fs] == \
        [(f.kind, f.step) for fs in again.values() for f in fs]
    for shape, faults in first.items():
        assert all(chaos.SHAPE_OF[f.kind] == shape and 1 <= f.step < 39 for f in faults)
        assert [f.step for f in faults] == sorted(f.step for f in faults)


def test_leftovers_are_the_run_procs_files_and_live_children(tmp_path):
    before, older = chaos.shm_files(), chaos.children()
    mine = chaos.SHM / "chaos-test-999999999.bin"  # named with a proc of the run's pid
    other = chaos.SHM / "chaos-test-someone-else.bin"
    for path in (mine, other):
        path.write_bytes(b"x")
    try:
        found = chaos.leftovers(before, {999999999}, older)
    finally:
        mine.unlink()
        other.unlink()
    assert found == {"procs": [], "shm": [str(mine)]}


async def test_faults_of_several_kinds_are_survived_with_the_same_metrics(tmp_path):
    """16 steps, a checkpoint every 4: on one slot, its proc killed while generating,
    during the weight handoff and during a checkpoint's background write, and stopped
    (SIGSTOP: a hang, found by the services' call bound); on two slots (DDP), one trainer
    rank's proc killed during the train step."""
    out = tmp_path / "chaos.json"
    kinds = ["kill-generator", "kill-during-handoff", "kill-during-save", "hang",
             "kill-trainer-rank"]
    args = chaos.parse(["--faults", "5", "--steps", "16", "--save-every", "4", "--seed", "1",
                        "--kinds", *kinds, "--out", str(out)])
    found = await chaos.main(args)
    assert json.loads(out.read_text())["injected"] == 5
    assert found["survived"] == found["injected"] == 5, found["faults"]
    assert found["equal_to_unfaulted"], found["runs"]
    assert found["leftovers"] == 0, found["runs"]
    for fault in found["faults"]:
        assert fault["outcome"] == "went on" and fault["detect_s"] < chaos.CALL_BOUND_S + 2
        assert 0 < fault["back_s"] and fault["steps_redone"] <= 4
    assert sorted(f["kind"] for f in found["faults"]) == sorted(kinds)
