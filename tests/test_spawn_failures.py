"""A tenant that cannot start fails its own spawn with one clear error, and only that:
the arbiters, the other tenants and the procs go on (real Monarch procs, CPU slots)."""

from __future__ import annotations

import os
import signal
import sys
import textwrap

import pytest
from monarch.actor import endpoint

from colocate.arbiter.actor import TenantActor
from colocate.resources.packing import ResourceRequest
from colocate.resources.spawning import SpawnError
from colocate.testing import MemoryTenant, start_runtime

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("procs_import_tests")]


class RaisingTenant(TenantActor):
    stages = {"weights": True}

    def __init__(self, model_dir: str) -> None:
        raise ValueError(f"model dir not found: {model_dir}")

    @endpoint
    def ping(self) -> int:
        return 1


class WrongStageTenant(TenantActor):
    stages = {"policy": True, "scratch": False}

    def __init__(self) -> None:
        with self.tenancy.region("weights"):
            self.x = 1

    @endpoint
    def ping(self) -> int:
        return 1


class QuittingTenant(TenantActor):
    def __init__(self) -> None:
        raise SystemExit("quitting")  # not an Exception: Monarch fails the actor

    @endpoint
    def ping(self) -> int:
        return 1


class FailsAtSleep(MemoryTenant):
    """Its actor (not its proc) fails when put to sleep: SystemExit is not an exception
    Monarch hands to the caller; it fails the actor."""

    @endpoint
    def sleep(self, stages: list[str] | None = None) -> int:
        raise SystemExit("failing instead of sleeping")


class ExitingTenant(TenantActor):
    def __init__(self) -> None:
        os._exit(3)

    @endpoint
    def ping(self) -> int:
        return 1


def values(mesh_result):
    return [value for _, value in mesh_result.items()]


async def spawn_memory(rm, name: str, group: str = "rl", procs: int = 2):
    request = ResourceRequest(group, 1, procs)
    return await rm.spawn(name, MemoryTenant, await rm.allocate(request, owner=name), 4, 1)


async def still_switches(rm, a, group: str = "rl", procs: int = 2) -> None:
    """A new tenant spawns on the same procs and the slot switches both ways, contents
    intact: the arbiter and the tenant `a` go on."""
    b = await spawn_memory(rm, "next", group, procs)
    await rm.wake("next")
    assert len(set(values(await b.checksum.call()))) == 1
    await rm.wake("a")
    assert len(values(await a.checksum.call())) == procs
    shared = [tenants for slots in (await rm.status()).values()
              for tenants in slots.values() if "a" in tenants]
    assert shared and all(tenants["a"] and not tenants["next"] for tenants in shared)


async def test_an_init_that_raises_fails_alone_and_leaves_no_trace():
    async with start_runtime(gpus_per_host=2) as rm:
        a = await spawn_memory(rm, "a")
        alloc = await rm.allocate(ResourceRequest("rl", 1, 2), owner="broken")
        with pytest.raises(SpawnError, match=r"'broken' \(test_spawn_failures.RaisingTenant\)"
                           r" failed to start: ValueError: model dir not found: /nope") as info:
            await rm.spawn("broken", RaisingTenant, alloc, "/nope")
        err = info.value
        assert (err.name, err.exception_type) == ("broken", "ValueError")
        assert isinstance(err.exception, ValueError) and not err.procs_lost
        assert not rm.faults.known("broken") and not rm.view.is_tenant("broken")
        assert not rm.group("rl").used["broken"]  # the allocation was given back
        await still_switches(rm, a)
        # the name is free again, on the same procs
        again = await rm.spawn("broken", MemoryTenant,
                               await rm.allocate(ResourceRequest("rl", 1, 2), owner="broken"), 4)
        await rm.wake("broken")
        assert len(values(await again.checksum.call())) == 2


async def test_an_unknown_stage_names_it_and_the_stages():
    async with start_runtime(gpus_per_host=1) as rm:
        a = await spawn_memory(rm, "a", procs=1)
        alloc = await rm.allocate(ResourceRequest("rl", 1, 1), owner="wrong")
        with pytest.raises(SpawnError, match=r"'wrong'.*UnknownStageError: unknown stage "
                           r"'weights'; stages: \['policy', 'scratch'\]") as info:
            await rm.spawn("wrong", WrongStageTenant, alloc)
        assert isinstance(info.value.exception, KeyError)
        await still_switches(rm, a, procs=1)


async def test_a_process_that_dies_in_init_loses_only_its_procs():
    async with start_runtime(gpus_per_host=2) as rm:
        a = await spawn_memory(rm, "a", procs=1)
        alloc = await rm.allocate(ResourceRequest("doomed", 1, 1), owner="exiting")
        # Monarch's own word for the death: the exit code, or, on a loaded machine, its
        # spawn's 30 s status timeout (seen under a CPU hog: "statuses: Timeout(30.0s)")
        with pytest.raises(SpawnError, match=r"'exiting'.*failed to start: .*(exited with "
                           r"non-zero code 3|statuses: Timeout).*rm.release\('doomed'\)"
                           ) as info:
            await rm.spawn("exiting", ExitingTenant, alloc)
        assert info.value.procs_lost and not rm.faults.known("exiting")
        await still_switches(rm, a, procs=1)
        await rm.release("doomed")  # as the error says: the slot is usable again
        c = await spawn_memory(rm, "c", group="doomed", procs=1)
        await rm.wake("c")
        assert len(values(await c.checksum.call())) == 1


async def test_a_class_the_procs_cannot_import_says_where_and_what_to_do(tmp_path,
                                                                        monkeypatch):
    (tmp_path / "users_own_tenants.py").write_text(textwrap.dedent("""
        from colocate.testing import MemoryTenant

        class UsersTenant(MemoryTenant):
            pass
    """))
    monkeypatch.syspath_prepend(str(tmp_path))  # here only: the procs do not see it
    from users_own_tenants import UsersTenant

    async with start_runtime(gpus_per_host=1) as rm:
        a = await spawn_memory(rm, "a", procs=1)
        alloc = await rm.allocate(ResourceRequest("rl", 1, 1), owner="users")
        with pytest.raises(SpawnError, match=r"(?s)cannot spawn 'users'.*"
                           r"No module named 'users_own_tenants'.*in the procs.*PYTHONPATH"
                           ) as info:
            await rm.spawn("users", UsersTenant, alloc, 4)
        assert str(tmp_path) in str(info.value)
        assert info.value.exception_type == "ModuleNotFoundError"
        await still_switches(rm, a, procs=1)  # the procs were not touched
    sys.modules.pop("users_own_tenants", None)


async def test_the_arbiter_survives_a_tenant_that_died_under_it():
    async with start_runtime(gpus_per_host=2) as rm:
        victim = await spawn_memory(rm, "victim", group="lost", procs=1)
        other = await spawn_memory(rm, "other", group="lost", procs=1)  # same proc
        a = await spawn_memory(rm, "a", group="rl", procs=1)
        os.kill((await victim.memory.call_one())["pid"], signal.SIGKILL)
        with pytest.raises(Exception):  # noqa: B017 - what matters is what comes after
            await rm.wake("other")  # the arbiter calls the dead victim to put it to sleep
        for name, actors in (("victim", victim), ("other", other)):
            await rm.remove(name, actors)
        await still_switches(rm, a, procs=1)  # the same arbiter serves slot 1



async def test_procs_that_refuse_new_actors_say_so_and_how_to_get_them_back():
    async with start_runtime(gpus_per_host=2) as rm:
        a = await spawn_memory(rm, "a", group="rl", procs=1)
        request = ResourceRequest("spoiled", 1, 1)
        with pytest.raises(SpawnError, match=r"'quitting'.*failed to start: .*quitting") as info:
            await rm.spawn("quitting", QuittingTenant, await rm.allocate(request, "quitting"))
        assert info.value.procs_lost
        with pytest.raises(SpawnError, match=r"cannot spawn 'next'.*take no new actor.*"
                           r"rm.release\('spoiled'\)") as info:
            await spawn_memory(rm, "next", group="spoiled", procs=1)
        assert info.value.procs_lost and not rm.faults.known("next")
        await rm.release("spoiled")
        c = await spawn_memory(rm, "c", group="spoiled", procs=1)
        await rm.wake("c")
        assert len(values(await c.checksum.call())) == 1
        await rm.wake("a")
        assert len(values(await a.checksum.call())) == 1


async def test_the_arbiter_survives_a_tenant_actor_that_failed_under_it():
    async with start_runtime(gpus_per_host=2) as rm:
        request = ResourceRequest("lost", 1, 1)
        await rm.spawn("failing", FailsAtSleep, await rm.allocate(request, "failing"), 4)
        await spawn_memory(rm, "asleep", group="lost", procs=1)
        a = await spawn_memory(rm, "a", group="rl", procs=1)
        with pytest.raises(Exception, match="failing"):
            await rm.wake("asleep")  # its actor fails as the arbiter calls it
        await still_switches(rm, a, procs=1)  # the same arbiter serves slot 1
