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
    assert kinds == sorted(chaos.MENU)  # 9 faults: each kind of the menu once
    assert [(f.kind, f.step) for fs in first.values() for f in fs] == \
        [(f.kind, f.step) for fs in again.values() for f in fs]
    for shape, faults in first.items():
        assert all(chaos.SHAPE_OF[f.kind] == shape and 1 <= f.step < 39 for f in faults)
        assert [f.step for f in faults] == sorted(f.step for f in faults)


async def test_faults_of_several_kinds_are_survived_with_the_same_metrics(tmp_path):
    """One slot, 16 steps, a checkpoint every 4: a slot proc killed while generating, a
    kill during the weight handoff, during a checkpoint's background write and during the
    group's restart."""
    out = tmp_path / "chaos.json"
    args = chaos.parse(["--faults", "4", "--steps", "16", "--save-every", "4", "--seed", "1",
                        "--kinds", "kill-generator", "kill-during-handoff",
                        "kill-during-save", "kill-during-restart", "--out", str(out)])
    found = await chaos.main(args)
    assert json.loads(out.read_text())["injected"] == 4
    assert found["survived"] == found["injected"] == 4, found["faults"]
    assert found["equal_to_unfaulted"], found["runs"]
    assert found["leftovers"] == 0, found["runs"]
    for fault in found["faults"]:
        assert fault["steps_redone"] <= 4 and fault["back_s"] > 0
    assert {f["kind"] for f in found["faults"]} == {"kill-generator", "kill-during-handoff",
                                                    "kill-during-save", "kill-during-restart"}
