"""What the tenants hold, per proc: the readings the loop takes at each phase switch.

`resident_per_proc` asks a service's healthy tenants what they hold on each proc, and
`devices_of` where they run.
`ProcPeaks` keeps, per proc, the most each tenant held at a phase switch and the most all
of them held together; its summary says whether the proc's peak stayed within its bound:
the slot's capacity under a budget, else max(trainer, generator) + the reference's weights
(the readings are taken once each switch is done; the arbiter has verified each release
before the next wake).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from colocate.arbiter import TenantInfo
from services import Service
from services.replica import ReplicaState


async def resident(service: Service) -> int:
    """Bytes the service's healthy tenants hold now, over all their procs."""
    return sum((await resident_per_proc(service)).values())


async def tenant_infos(service: Service) -> list[TenantInfo]:
    """What each of the service's healthy tenants says of itself on each of its procs
    (asked directly, since a sleeping replica takes no routed calls; a replica that died
    took what it held with its procs)."""
    infos: list[TenantInfo] = []
    for replica in service.replicas:
        if replica.state is ReplicaState.HEALTHY:
            infos += [info for _, info in (await replica.actors.describe.call()).items()]
    return infos


async def resident_per_proc(service: Service) -> dict[int, int]:
    """Bytes the service's healthy tenants hold now, per proc (pid)."""
    held: dict[int, int] = {}
    for info in await tenant_infos(service):
        held[info.pid] = held.get(info.pid, 0) + info.resident_bytes
    return held


async def devices_of(service: Service) -> list[str]:
    """Where the service's healthy tenants run: "cpu", or their GPUs' UUIDs, sorted."""
    return sorted({info.device for info in await tenant_infos(service)})


class ProcPeaks:
    """Per proc (pid): the most each tenant held at a reading, and the most all held at
    once."""

    def __init__(self) -> None:
        self.tenant: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.together: dict[int, int] = defaultdict(int)

    def add(self, readings: dict[str, dict[int, int]]) -> None:
        """One moment's readings: tenant -> pid -> resident bytes."""
        now: dict[int, int] = defaultdict(int)
        for name, per_proc in readings.items():
            for pid, held in per_proc.items():
                self.tenant[name][pid] = max(self.tenant[name][pid], held)
                now[pid] += held
        for pid, held in now.items():
            self.together[pid] = max(self.together[pid], held)

    def summary(self, shared: bool = False, capacity: int | None = None) -> dict[str, Any]:
        """The worst proc's peak against its bound: taking turns, max(trainer, generator) +
        reference; `shared` (a budget keeps tenants awake together), the slot's
        `capacity` (None: a GPU's own memory, which its arbiter measures: no bound here)."""
        rows = []
        for pid, peak in self.together.items():
            bound = max(self.tenant["trainer"][pid], self.tenant["generator"][pid]) \
                + self.tenant["reference"][pid]
            if shared:
                bound = peak if capacity is None else capacity
            rows.append({"peak_bytes": peak, "bound_bytes": bound,
                         "reference_bytes": self.tenant["reference"][pid]})
        worst = max(rows, key=lambda r: r["peak_bytes"] / max(r["bound_bytes"], 1))
        return {**worst, "within_bound": all(r["peak_bytes"] <= r["bound_bytes"]
                                              for r in rows), "procs": len(rows)}
