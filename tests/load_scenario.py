"""Routed load with phase switches and a killed proc: the scenario behind
tests/test_load_faults.py and bench/load_faults.py.

Two services share one resource group of 4 slots: "trainer" (2 replicas x 2 procs) and
"generator" (4 replicas x 1 proc), both `FaultyTenant`s (tests/faulty.py). Phases
alternate every 20-100 ms (random) while `calls` routed calls run, sent by `clients`
concurrent clients, one in `error_every` of them an endpoint error (`work(x < 0)` raises).
When a random share (20-60 %) of the calls have ended, at the next moment with no routed
call in flight there, the proc of a random generator replica is SIGKILLed: it also hosts a
rank of a trainer replica, so both services lose a replica and respawn it. The report says
what became of every call, whether any reached a sleeping replica, what the phase loop met,
and how long the killed replicas took to come back.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from faulty import FaultyTenant, InjectedFault

from colocate import phase
from colocate.resources.manager import ResourceManager
from services import Service, ServiceConfig, spawn_service
from services.replica import ReplicaState

SWITCH_S = (0.02, 0.1)
KILL_AT = (0.2, 0.6)  # the kill comes after this share of the calls ended (random in it)


@dataclass
class LoadReport:
    """What became of the calls, the phases and the killed replicas."""

    calls: int
    answered: int = 0
    endpoint_errors: int = 0
    errors_to_others: list[str] = field(default_factory=list)  # an error for another call
    wrong_answers: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)  # ended in an error not its own
    asleep_seen_by_callers: int = 0
    asleep_counted_by_tenants: int = 0
    awake_counted_by_tenants: int = 0
    phases: int = 0
    phase_errors: list[str] = field(default_factory=list)
    killed_pid: int | None = None
    killed_tenants: list[str] = field(default_factory=list)
    kill_at_s: float | None = None  # after the load started
    failed_s: dict[str, float] = field(default_factory=dict)  # service -> kill to seen failed
    back_s: dict[str, float] = field(default_factory=dict)  # service -> kill to healthy
    served_after: dict[str, bool] = field(default_factory=dict)  # respawned one answers
    seconds: float = 0.0
    latencies_s: list[float] = field(default_factory=list)

    def summary(self) -> str:
        lat = sorted(self.latencies_s) or [0.0]
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        return (f"{self.calls} calls in {self.seconds:.1f} s ({self.calls / self.seconds:.0f}/s; "
                f"p50 {statistics.median(lat) * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms): "
                f"{self.answered} answered, {self.endpoint_errors} endpoint errors to their "
                f"own callers, {len(self.errors_to_others)} to others, {len(self.lost)} lost, "
                f"{len(self.wrong_answers)} wrong; served asleep: {self.asleep_seen_by_callers}"
                f" (callers), {self.asleep_counted_by_tenants} (tenants, of "
                f"{self.asleep_counted_by_tenants + self.awake_counted_by_tenants}); "
                f"{self.phases} phases, {len(self.phase_errors)} failed; " + self._kill())

    def _kill(self) -> str:
        if self.killed_pid is None:
            return "no kill"
        return (f"killed pid {self.killed_pid} ({', '.join(self.killed_tenants)}) at "
                f"{self.kill_at_s or 0:.2f} s; seen failed after: "
                + ", ".join(f"{k} {v:.2f} s" for k, v in self.failed_s.items())
                + "; back after: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.back_s.items()))


async def start_services(rm: ResourceManager) -> tuple[Service, Service]:
    trainer = await spawn_service(
        ServiceConfig(num_replicas=2, procs_per_host=2, resource_group="rl"),
        FaultyTenant, 1, 1, 1, name="trainer", rm=rm)
    generator = await spawn_service(
        ServiceConfig(num_replicas=4, procs_per_host=1, resource_group="rl",
                      router="least_loaded"),
        FaultyTenant, 1, 1, 2, name="generator", rm=rm)
    return trainer, generator


async def run_load(rm: ResourceManager, calls: int = 2000, clients: int = 200,
                   error_every: int = 20, kill: bool = True, seed: int = 0,
                   back_within_s: float = 120.0) -> LoadReport:
    """Start the two services, run the load (`clients` concurrent clients share the calls,
    each sending its next when the last ended; killing a proc if `kill`), wait up to
    `back_within_s` for the killed replicas, and report."""
    rng = random.Random(seed)
    trainer, generator = await start_services(rm)
    services = {"trainer": trainer, "generator": generator}
    report = LoadReport(calls)
    stop = asyncio.Event()

    async def alternate() -> None:
        while not stop.is_set():
            for svc in (generator, trainer):
                try:
                    async with phase(svc, rm=rm):
                        report.phases += 1
                        await asyncio.sleep(rng.uniform(*SWITCH_S))
                except Exception as err:  # a replica lost under the switch: said, go on
                    report.phase_errors.append(f"{type(err).__name__}: {err}")
                    await asyncio.sleep(SWITCH_S[0])

    async def one(r: int) -> None:
        svc = trainer if r % 3 == 0 else generator
        x = -(r + 1) if r % error_every == 0 else r
        start = time.monotonic()
        try:
            out = await svc.work.route(x)
        except InjectedFault as err:
            report.endpoint_errors += 1
            if f"request {x} refused" not in str(err):
                report.errors_to_others.append(f"call {x} got: {err}")
            return
        except Exception as err:
            report.lost.append(f"call {x}: {type(err).__name__}: {err}")
            return
        finally:
            report.latencies_s.append(time.monotonic() - start)
        report.answered += 1
        report.asleep_seen_by_callers += bool(out["asleep"])
        if out["x"] != x or x < 0:
            report.wrong_answers.append(f"call {x} got {out}")

    victim = rng.choice(generator.replicas)
    pid = (await victim.actors.held.call_one())["pid"]
    procs = {n: s for n, svc in services.items() for s in _replicas_on(svc, victim)}

    async def killer(t0: float) -> None:
        share = rng.uniform(*KILL_AT)
        while report.answered + report.endpoint_errors + len(report.lost) < share * calls:
            await asyncio.sleep(0.001)
        report.killed_pid, report.kill_at_s = pid, time.monotonic() - t0
        report.killed_tenants = [r.tenant for r in procs.values()]
        os.kill(pid, signal.SIGKILL)

    switching = asyncio.create_task(alternate())
    t0 = time.monotonic()
    killing = watching = None
    if kill:
        killing = asyncio.create_task(killer(t0))
        watching = asyncio.create_task(_watch(procs, t0, back_within_s, report))
    async def client(c: int) -> None:
        for r in range(c, calls, clients):
            await one(r)

    await asyncio.gather(*(client(c) for c in range(clients)))
    report.seconds = time.monotonic() - t0
    if killing is not None and watching is not None:
        await killing
        await watching
    stop.set()
    await switching
    for name, replica in procs.items() if kill else ():
        svc = services[name]
        if replica.state is ReplicaState.HEALTHY:
            async with phase(svc, rm=rm):
                answers = await svc.work.fanout(1)
            report.served_after[name] = any(a["tenant"] == replica.tenant for a in answers)
    for svc in services.values():
        for replica in svc.replicas:
            if replica.state is ReplicaState.HEALTHY:
                for _, counts in (await replica.actors.counts.call()).items():
                    report.asleep_counted_by_tenants += counts["asleep"]
                    report.awake_counted_by_tenants += counts["awake"]
    return report


def _replicas_on(svc: Service, victim: Any) -> list[Any]:
    """The replicas of `svc` with a proc on the victim's slot (so on its proc)."""
    slots = set(victim.allocation.slots)
    return [r for r in svc.replicas if slots & set(r.allocation.slots)]


async def _watch(procs: dict[str, Any], t0: float, within_s: float,
                 report: LoadReport) -> None:
    """Record when each service saw its replica on the killed proc fail, and when it was
    back (respawned and healthy), up to `within_s` after the kill."""
    while report.kill_at_s is None:
        await asyncio.sleep(0.01)
    killed_at = t0 + report.kill_at_s
    while time.monotonic() < killed_at + within_s and len(report.back_s) < len(procs):
        for name, replica in procs.items():
            now = time.monotonic() - killed_at
            if name not in report.failed_s and (replica.state is not ReplicaState.HEALTHY
                                                or replica.generation):
                report.failed_s[name] = now
            if name not in report.back_s and replica.generation and \
                    replica.state is ReplicaState.HEALTHY:
                report.back_s[name] = now
        await asyncio.sleep(0.01)
