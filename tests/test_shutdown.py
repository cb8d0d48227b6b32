"""`rm.shutdown()` with calls in flight and switches under way: every call ends, with an
error; no process the runtime started is left (checked by pid); and `init` works again in
the same process."""

from __future__ import annotations

import asyncio
import time

import psutil
import pytest
from faulty import FaultyTenant

from colocate import phase
from colocate.arbiter import ArbiterConfig
from colocate.resources.manager import ResourceManager, init
from colocate.resources.packing import ResourceRequest
from services import ServiceConfig, spawn_service

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("procs_import_tests")]

CONFIG = ArbiterConfig(call_timeout_s=30.0)
ENDED_WITHIN_S = 15.0  # after shutdown returns, every call and switch has ended by then
STOPPED_WITHIN_S = 5.0  # after shutdown returns, every process it started is gone


def descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def running(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.add(pid)
        except psutil.NoSuchProcess:
            pass
    return out


async def none_left(pids: set[int], within_s: float) -> set[int]:
    deadline = time.monotonic() + within_s
    while (left := running(pids)) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return left


async def busy_runtime() -> tuple[ResourceManager, list[asyncio.Task], dict[str, asyncio.Task]]:
    """A runtime with routed calls in flight and waiting, a switch waiting for them to drain,
    and a switch stuck in the arbiter on a tenant that hangs as it wakes."""
    rm = await init("local", 1, 4, arbiter=CONFIG)
    trainer = await spawn_service(ServiceConfig(procs_per_host=2, resource_group="rl"),
                                  FaultyTenant, 1, 1, 1, name="trainer", rm=rm)
    generator = await spawn_service(
        ServiceConfig(num_replicas=2, procs_per_host=1, resource_group="rl"),
        FaultyTenant, 1, 1, 2, name="generator", rm=rm)
    request = ResourceRequest("other", 1, 2)
    stuck = {n: await rm.spawn(n, FaultyTenant, await rm.allocate(request, n), 1, 1, seed)
             for seed, n in enumerate(("a", "b"), 3)}
    await rm.wake("a")
    await stuck["b"].arm.call("wake:weights", "hang", 2, 60.0)  # slot 2: group "other"
    async with phase(generator, rm=rm):
        calls = [asyncio.create_task(generator.work.route(i, 3.0)) for i in range(8)]
        calls += [asyncio.create_task(trainer.work.route(100 + i)) for i in range(8)]
        while sum(r.in_flight for r in generator.replicas) < 2:  # in the replicas now
            await asyncio.sleep(0.01)
    switches = {"to trainer (draining)": asyncio.create_task(rm.wake(trainer.tenant_names()[0])),
                "to b (hung in b.wake)": asyncio.create_task(rm.wake("b"))}
    await asyncio.sleep(0.5)
    assert not any(t.done() for t in [*calls, *switches.values()]), "nothing was under way"
    return rm, calls, switches


async def test_shutdown_ends_every_call_leaves_no_proc_and_init_works_again():
    before = descendants()
    rm, calls, switches = await busy_runtime()
    started = descendants() - before
    assert len(started) >= 7  # 4 + 2 slot procs, the arbiter's proc, the host agent...

    start = time.monotonic()
    await rm.shutdown()
    shutdown_s = time.monotonic() - start
    tasks = [*calls, *switches.values()]
    _, pending = await asyncio.wait(tasks, timeout=ENDED_WITHIN_S)
    left = await none_left(started, STOPPED_WITHIN_S)
    outcomes = [("pending" if t in pending else
                 "answered" if t.exception() is None else type(t.exception()).__name__)
                for t in tasks]
    print(f"\nshutdown took {shutdown_s:.1f} s; calls: {outcomes[:len(calls)]}; switches: "
          f"{dict(zip(switches, outcomes[len(calls):], strict=True))}; procs left: {left}")
    for task in pending:
        task.cancel()
    assert not pending, f"{len(pending)} calls or switches still pending after shutdown"
    in_flight = outcomes[:8]  # the generator's calls, in its replicas at shutdown
    assert "answered" not in in_flight, outcomes
    assert not left, f"procs left behind: {left}"

    # a new runtime in the same process
    before = descendants()
    async with asyncio.timeout(120):
        rm = await init("local", 1, 2, arbiter=CONFIG)
        try:
            request = ResourceRequest("rl", 1, 2)
            a = await rm.spawn("a", FaultyTenant, await rm.allocate(request, "a"), 1, 1, 1)
            b = await rm.spawn("b", FaultyTenant, await rm.allocate(request, "b"), 1, 1, 2)
            await rm.wake("b")
            assert (await rm.status())[0][0] == {"a": [], "b": ["weights", "cache"]}
            sums = [v for _, v in (await b.checksum.call()).items()]
            await rm.wake("a")
            assert len({v for _, v in (await a.checksum.call()).items()}) == 2
            await rm.wake("b")
            assert [v for _, v in (await b.checksum.call()).items()] == sums
        finally:
            started = descendants() - before
            await rm.shutdown()
    assert not await none_left(started, STOPPED_WITHIN_S)
