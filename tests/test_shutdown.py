"""`rm.shutdown()` with calls in flight and switches under way: no process the runtime
started is left (checked by pid), `init` works again in the same process, and every call
ends with an error (or with the answer of an awake replica that finished before its proc
stopped), as does every switch. And `rm.release(group)`, which shutdown runs, leaves none
of the group's tenants routable."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from faulty import FaultyTenant
from monarch.actor import Actor, endpoint

from colocate import phase, shm_files
from colocate.arbiter import ArbiterConfig
from colocate.resources import zygote
from colocate.resources.manager import ResourceManager
from colocate.resources.packing import ResourceRequest
from colocate.resources.start import init
from colocate.testing import start_runtime
from services import Service, ServiceConfig, spawn_service
from services.replica import ReplicaState

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("procs_import_tests")]

CONFIG = ArbiterConfig(call_timeout_s=30.0)
ENDED_WITHIN_S = 15.0  # after shutdown returns, every call and switch has ended by then
STOPPED_WITHIN_S = 5.0  # after shutdown returns, every process it started is gone


def descendants() -> set[int]:
    """This process's descendants but its fork server, which serves every runtime here."""
    return {p.pid for p in psutil.Process().children(recursive=True)} - {zygote.server_pid()}


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


@dataclass
class Busy:
    """A runtime in the middle of things, and the processes it started."""

    rm: ResourceManager
    calls: list[asyncio.Task]  # routed: the generator's in its replicas, the trainer's waiting
    switches: dict[str, asyncio.Task]
    procs: set[int]
    services: list[Service]


async def busy_runtime() -> Busy:
    """Routed calls in flight and waiting, a switch waiting for them to drain, and a switch
    stuck in the arbiter on a tenant that hangs as it wakes."""
    before = descendants()
    rm = await init("local", 1, 4, arbiter=CONFIG)
    trainer = await spawn_service(ServiceConfig(procs_per_host=2, resource_group="rl"),
                                  FaultyTenant, 1, 1, 1, name="trainer", rm=rm)
    generator = await spawn_service(
        ServiceConfig(num_replicas=2, procs_per_host=1, resource_group="rl"),
        FaultyTenant, 1, 1, 2, name="generator", rm=rm)
    request = ResourceRequest("other", 1, 2)  # slots 2 and 3
    stuck = {n: await rm.spawn(n, FaultyTenant, await rm.allocate(request, n), 1, 1, seed)
             for seed, n in enumerate(("a", "b"), 3)}
    await rm.wake("a")
    await stuck["b"].arm.call("wake:weights", "hang", 2, 60.0)
    async with phase(generator, rm=rm):
        calls = [asyncio.create_task(generator.work.route(i, 3.0)) for i in range(8)]
        calls += [asyncio.create_task(trainer.work.route(100 + i)) for i in range(8)]
        while sum(r.in_flight for r in generator.replicas) < 2:  # in the replicas now
            await asyncio.sleep(0.01)
    switches = {"to trainer (draining)": asyncio.create_task(rm.wake(trainer.tenant_names()[0])),
                "to b (hung in b.wake)": asyncio.create_task(rm.wake("b"))}
    await asyncio.sleep(0.5)
    assert not any(t.done() for t in [*calls, *switches.values()]), "nothing was under way"
    procs = descendants() - before
    slot_procs = {pid for group in ("rl", "other") for pid in rm.group(group).pids}
    assert len(slot_procs) == 4 and slot_procs < procs  # and the arbiter's proc
    return Busy(rm, calls, switches, procs, [trainer, generator])


def outcome(task: asyncio.Task) -> str:
    if not task.done():
        return "pending"
    if task.exception() is not None:
        return type(task.exception()).__name__
    return "answered asleep" if task.result().get("asleep") else "answered"


async def test_shutdown_with_calls_in_flight_leaves_no_proc_and_init_works_again():
    busy = await busy_runtime()
    start = time.monotonic()
    await busy.rm.shutdown()
    print(f"\nshutdown took {time.monotonic() - start:.1f} s")
    assert not await none_left(busy.procs, STOPPED_WITHIN_S), "procs left behind"
    for task in [*busy.calls, *busy.switches.values()]:
        task.cancel()

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


async def test_shutdown_ends_every_call_and_switch_with_an_error():
    busy = await busy_runtime()
    await busy.rm.shutdown()
    tasks = [*busy.calls, *busy.switches.values()]
    await asyncio.wait(tasks, timeout=ENDED_WITHIN_S)
    outcomes = [outcome(task) for task in tasks]
    print(f"\ncalls: {outcomes[:len(busy.calls)]}; switches: "
          f"{dict(zip(busy.switches, outcomes[len(busy.calls):], strict=True))}")
    for task in tasks:
        task.cancel()
    assert not await none_left(busy.procs, STOPPED_WITHIN_S)
    assert not {"pending", "answered asleep"} & set(outcomes), outcomes
    assert all(o not in ("answered", "answered asleep") for o in outcomes[len(busy.calls):])
    # the services were closed first: no replica respawning on the released procs
    assert {r.state for svc in busy.services for r in svc.replicas} == {ReplicaState.STOPPED}


async def test_a_released_groups_tenants_are_not_routable():
    async with start_runtime(gpus_per_host=1) as rm:
        request = ResourceRequest("g", 1, 1)
        for seed, name in enumerate(("a", "b"), 1):
            await rm.spawn(name, FaultyTenant, await rm.allocate(request, name), 1, 1, seed)
        assert (rm.routable("a"), rm.routable("b")) == (True, False)  # b asleep
        await rm.release("g", grace_s=1.0)
        assert (rm.routable("a"), rm.routable("b")) == (False, False)


class ShmWriter(Actor):
    """Makes a shared-memory file and records it, as vLLM's CPU communicator does."""

    @endpoint
    def make(self, tag: str) -> str:
        path = f"/dev/shm/colocate-test-{tag}-{os.getpid()}"
        shm_files.record([path])
        Path(path).write_bytes(b"x")
        return path


async def test_a_release_cancelled_while_it_stops_the_procs_is_finished_by_shutdown():
    """A group restart that fails releases its group; a shutdown then cancels that release
    mid-stop. The group stays the runtime's until its procs are stopped, so shutdown stops
    them and removes the files they recorded."""
    async with start_runtime(gpus_per_host=2) as rm:
        group = await rm.reserve(ResourceRequest("g", 1, 2))
        writers = group.procs.spawn("writer", ShmWriter)
        files = [path for _, path in (await writers.make.call(uuid.uuid4().hex)).items()]
        assert all(Path(f).exists() for f in files)
        release = asyncio.ensure_future(rm.release("g", grace_s=5.0))
        await asyncio.sleep(0.05)
        release.cancel()
        await asyncio.gather(release, return_exceptions=True)
        assert release.cancelled() and "g" in rm.groups.groups  # not forgotten half done
    assert await none_left(set(group.pids), STOPPED_WITHIN_S) == set()
    assert [f for f in files if Path(f).exists()] == []
