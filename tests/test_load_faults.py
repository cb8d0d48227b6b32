"""Load with faults: 2,000 routed calls at once over 2 services on 4 slots, phases switching
every 20-100 ms, a proc SIGKILLed at a random moment (tests/load_scenario.py). No call is
lost, none reaches a sleeping replica, every endpoint error reaches its own caller, and the
replicas on the killed proc come back within BACK_WITHIN_S (the time is printed)."""

from __future__ import annotations

import pytest
from load_scenario import run_load

from colocate.testing import start_runtime

pytestmark = [pytest.mark.timeout(400), pytest.mark.usefixtures("procs_import_tests")]

CALLS = 2000
BACK_WITHIN_S = 90.0  # kill -> respawned replica healthy, on a loaded 2-core machine


async def test_routed_load_with_switches_and_a_killed_proc_loses_no_call():
    async with start_runtime(gpus_per_host=4) as rm:
        report = await run_load(rm, calls=CALLS, seed=14, back_within_s=BACK_WITHIN_S)
    print("\n" + report.summary())
    for error in report.phase_errors:
        print("  phase error:", error[:300])
    assert report.lost == [] and report.wrong_answers == []
    assert report.answered + report.endpoint_errors == CALLS
    assert report.endpoint_errors == len(range(0, CALLS, 20)) and not report.errors_to_others
    assert report.asleep_seen_by_callers == 0 and report.asleep_counted_by_tenants == 0
    assert report.phases > 20
    assert set(report.back_s) == {"trainer", "generator"}, report.back_s
    assert max(report.back_s.values()) < BACK_WITHIN_S
    assert report.served_after == {"trainer": True, "generator": True}
    # the phase loop met only the killed replicas' loss, each said as such
    for error in report.phase_errors:
        assert any(name in error for name in report.killed_tenants), error
