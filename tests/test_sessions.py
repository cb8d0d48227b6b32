"""Sessions of the service layer on real Monarch procs: a session the caller names is
resumed on its replica by later blocks, in other tasks, until the caller ends it; and a
session's end is final, even for a call that a task started in its block makes later."""

from __future__ import annotations

import asyncio

import pytest

from colocate.testing import MemoryTenant, start_runtime
from services import ServiceConfig, spawn_service

pytestmark = pytest.mark.timeout(300)


async def two_replicas(name: str = "counter"):
    return await spawn_service(ServiceConfig(num_replicas=2, procs_per_host=1,
                                             resource_group=name, router="round_robin"),
                               MemoryTenant, 1, name=name)


async def pid(svc) -> int:
    return (await svc.memory.route())["pid"]


async def test_a_late_call_does_not_bring_an_ended_session_back():
    async with start_runtime(gpus_per_host=2):
        svc = await two_replicas()
        go = asyncio.Event()

        async def late() -> int:
            await go.wait()
            return await pid(svc)  # its context is the block's: the session's id

        async with svc.session() as session:
            first = await pid(svc)
            task = asyncio.create_task(late())
        assert svc.router.sessions == {} and svc.router.current() is None
        go.set()
        await task
        assert svc.router.sessions == {}, f"{session} came back after its end"
        assert len({await pid(svc) for _ in range(4)}) == 2  # round robin as before
        assert first


async def test_a_named_session_is_resumed_on_its_replica_until_ended():
    async with start_runtime(gpus_per_host=2):
        svc = await two_replicas()
        async with svc.session(id="traj-7") as session:
            assert session == "traj-7"
            mine = await pid(svc)
        assert svc.router.sessions.get("traj-7") is not None  # kept after its block
        others = {await pid(svc) for _ in range(4)}
        assert len(others) == 2  # calls outside it go round both replicas

        async def turn() -> set[int]:  # a later turn, in a task of its own
            async with svc.session(id="traj-7"):
                return {await pid(svc) for _ in range(4)}

        assert await asyncio.gather(turn(), turn()) == [{mine}, {mine}]
        async with svc.session(id="traj-8"):  # another trajectory: its own replica
            await pid(svc)
        assert set(svc.router.sessions) == {"traj-7", "traj-8"}
        svc.router.end("traj-7")
        assert set(svc.router.sessions) == {"traj-8"}
        with pytest.raises(ValueError, match="session id '': give a non-empty str"):
            async with svc.session(id=""):
                pass
