"""A test tenant with a preemptible endpoint whose answer to a preempt is set by the test.

`SpinTenant.spin(seconds)` is `@preemptible`: it runs for `seconds`, polling its preempt
flag every 10 ms, and says whether it stopped early. `slow(seconds)` is not preemptible.
Its `mode` (`set_mode`) decides its `preempt` hook:

    honour       the hook asks, spin polls and returns early
    ignore       the hook says yes, but spin never looks (a tenant that does not honour it)
    unsupported  the hook says its calls cannot stop early (they drain)

The procs import this module by name: the test puts tests/ on their PYTHONPATH.
"""

from __future__ import annotations

import time
from typing import Any

from monarch.actor import endpoint

from colocate.calls import preemptible
from colocate.testing import MemoryTenant

MODES = ("honour", "ignore", "unsupported")


class SpinTenant(MemoryTenant):
    def __init__(self, mib: int, mode: str = "honour") -> None:
        super().__init__(mib)
        self.mode = mode

    @endpoint
    def set_mode(self, mode: str) -> None:
        assert mode in MODES, mode
        self.mode = mode

    @endpoint
    @preemptible
    def spin(self, seconds: float) -> dict[str, Any]:
        self.tenancy.ensure_awake()
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            if self.mode == "honour" and self.preemption.asked():
                return {"early": True, "ran_s": time.monotonic() - start}
            time.sleep(0.01)
        return {"early": False, "ran_s": time.monotonic() - start}

    @endpoint
    def slow(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def preempt(self) -> bool:
        if self.mode == "unsupported":
            return False
        self.preemption.request()
        return True
