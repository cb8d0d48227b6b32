"""A resource group that comes back whole (`ServiceConfig(restart="group")`) and the
always-on proc watch, on real Monarch procs (CPU slots): a SIGKILLed slot proc restarts
every service of its group on one new proc per slot, tenants that shared a process share
one again, the hook sees one event, and a call in flight ends within a second."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from colocate import phase
from colocate.engines.actors import TrainerActor
from colocate.engines.tiny import write_tiny_model
from colocate.telemetry import process_runs
from colocate.testing import MemoryTenant, start_runtime
from services import (
    ReplicaLostError,
    RestartEvent,
    ServiceConfig,
    ServiceConfigError,
    ServiceUnavailableError,
    group_restarts,
    spawn_service,
)
from services.replica import Replica, ReplicaState

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("procs_import_tests")]


def test_the_restart_policy_is_checked_with_the_config():
    assert ServiceConfig().restart == "replica"
    assert ServiceConfig(restart="group").respawn
    with pytest.raises(ServiceConfigError, match=r"restart='node': use one of \('replica'"):
        ServiceConfig(restart="node")
    with pytest.raises(ServiceConfigError, match="respawn=False says never respawn"):
        ServiceConfig(restart="group", respawn=False)
    with pytest.raises(ServiceConfigError, match="fixed shape"):
        ServiceConfig(restart="group", max_replicas=2)
    ServiceConfig(respawn=False)  # no respawn at all, as before


async def pids(replica: Replica) -> list[int]:
    """The pid of each proc of a replica, in rank order."""
    return [info["pid"] for _, info in (await replica.actors.memory.call()).items()]


async def until(check, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_a_group_comes_back_whole_in_shared_processes():
    async with start_runtime(gpus_per_host=3) as rm:
        events: list[RestartEvent] = []
        restarts = group_restarts("rl")
        trainer = await spawn_service(
            ServiceConfig(procs_per_host=2, resource_group="rl", restart="group"),
            MemoryTenant, 8, name="trainer")
        generator = await spawn_service(
            ServiceConfig(num_replicas=2, resource_group="rl", restart="group",
                          when_asleep="wake"), MemoryTenant, 8, name="generator")
        solo = await spawn_service(ServiceConfig(resource_group="solo"), MemoryTenant, 1,
                                   name="solo")  # restart="replica": as before
        assert generator.restarts is trainer.restarts is restarts

        async def reload(event: RestartEvent) -> None:
            # the group is back: routed calls from here reach it (others wait)
            assert await generator.work.route(5) == 5
            events.append(event)

        restarts.on_restart.append(reload)
        with pytest.raises(ServiceConfigError, match="same restart policy"):
            await spawn_service(ServiceConfig(resource_group="rl"), MemoryTenant, 1,
                                name="other")

        old = await pids(trainer.replicas[0])
        assert [(await pids(r))[0] for r in generator.replicas] == old  # shared processes
        victim, other = generator.replicas
        async with phase(generator):
            lost = asyncio.ensure_future(victim.call("work", (1, 10.0), {}))
            routed = asyncio.ensure_future(generator.work.route(2, 1.0))
            await until(lambda: victim.in_flight and victim.in_flight + other.in_flight >= 2)
            await asyncio.sleep(0.3)  # both running in their procs now
            killed = time.monotonic()
            os.kill(old[0], signal.SIGKILL)
            with pytest.raises(ReplicaLostError):
                await lost
            seen = time.monotonic() - killed
        print(f"kill -> ReplicaLostError: {seen:.3f} s")
        assert seen < 1.5

        assert await asyncio.wait_for(routed, 60) == 2  # retried once the group is back
        assert len(events) == 1
        event = events[0]
        assert (event.group, event.count, event.services, event.error) == (
            "rl", 1, ("trainer", "generator"), None)
        assert f"pid {old[0]}" in event.cause and 0 < event.seconds < 60
        assert abs(event.detected_at - time.time()) < 60
        print(f"group restart: {event.seconds:.2f} s")
        for replica in (*trainer.replicas, *generator.replicas):
            assert (replica.state, replica.generation) == (ReplicaState.HEALTHY, 1), replica.failure
        new = await pids(trainer.replicas[0])
        assert [(await pids(r))[0] for r in generator.replicas] == new  # shared again
        assert not set(new) & set(old)
        assert not any(process_runs(pid) for pid in old)  # the dead generation is gone
        async with phase(generator):
            assert await generator.work.fanout(3) == [3, 3]
        async with phase(trainer):
            assert await trainer.work.route(4) == 4
        status = await rm.status()
        assert set(status[0][0]) == {"trainer_r0_g1", "generator_r0_g1"}  # old ones gone

        # Monarch's own reports of the old generation come seconds later: no second restart
        await asyncio.sleep(8)
        assert len(events) == len(restarts.events) == 1
        assert all(r.state is ReplicaState.HEALTHY and r.generation == 1
                   for r in (*trainer.replicas, *generator.replicas))

        # a restart="replica" service comes back alone, as before
        solo_pid = (await pids(solo.replicas[0]))[0]
        os.kill(solo_pid, signal.SIGKILL)
        await until(lambda: solo.replicas[0].generation == 1
                    and solo.replicas[0].state is ReplicaState.HEALTHY)
        assert await solo.work.route(6) == 6
        assert len(restarts.events) == 1 and group_restarts("solo").events == []
        assert (await pids(trainer.replicas[0])) == new


class FailsOnRestart(MemoryTenant):
    """Starts once; its __init__ raises on every later start (a file marks the first)."""

    def __init__(self, mib: int, marker: str) -> None:
        if Path(marker).exists():
            raise RuntimeError("cannot load the checkpoint")
        super().__init__(mib)
        Path(marker).touch()


async def test_a_restart_that_fails_leaves_the_services_failed_and_nothing_running(tmp_path):
    async with start_runtime(gpus_per_host=2) as rm:
        first = await spawn_service(ServiceConfig(procs_per_host=2, resource_group="rl",
                                                  restart="group"), MemoryTenant, 1,
                                    name="first")
        second = await spawn_service(ServiceConfig(resource_group="rl", restart="group"),
                                     FailsOnRestart, 1, str(tmp_path / "started"),
                                     name="second")
        old = await pids(first.replicas[0])
        os.kill(old[1], signal.SIGKILL)
        await until(lambda: first.restarts.events)
        event = first.restarts.events[0]
        assert "cannot load the checkpoint" in event.error
        for replica in (*first.replicas, *second.replicas):
            assert replica.state is ReplicaState.FAILED
            assert "did not come back" in replica.failure
            assert "cannot load the checkpoint" in replica.failure
        with pytest.raises(ServiceUnavailableError, match="cannot load the checkpoint"):
            await second.work.route(1)
        assert not rm.has_group("rl")  # its procs were released
        assert await rm.status() == {0: {0: {}, 1: {}}}  # no tenant left at the arbiters
        assert not any(process_runs(pid) for pid in old)
        await first.shutdown(grace_s=1)
        await second.shutdown(grace_s=1)


def shift_loss(module, batch):
    return module(input_ids=batch).logits[..., 5].mean(), {}


async def test_a_two_proc_trainer_comes_back_on_two_new_procs_and_trains(tmp_path):
    model_dir = str(write_tiny_model(tmp_path / "model", "qwen2", alphabet="0123456789+=>",
                                     tie_embeddings=True, init_std=0.1))
    batch = torch.tensor([[1, 4, 5, 13, 6, 7, 14], [1, 12, 3, 8, 13, 4, 14]])
    async with start_runtime(gpus_per_host=2):
        trainer = await spawn_service(
            ServiceConfig(procs_per_host=2, resource_group="rl", restart="group"),
            TrainerActor, model_dir, lr=0.05, name="trainer", parallel="ddp")
        await trainer.train_step.route(shift_loss, batch)
        replica = trainer.replicas[0]
        old = [info.pid for _, info in (await replica.actors.describe.call()).items()]
        os.kill(old[1], signal.SIGKILL)
        await until(lambda: trainer.restarts.events, 120)
        assert trainer.restarts.events[0].error is None
        assert (replica.state, replica.generation) == (ReplicaState.HEALTHY, 1)
        new = [info.pid for _, info in (await replica.actors.describe.call()).items()]
        assert len(new) == 2 and not set(new) & set(old)
        metrics = await trainer.train_step.route(shift_loss, batch)  # a new world of 2
        assert metrics["loss"] == metrics["loss"]  # a number


async def test_a_call_in_a_dead_proc_ends_within_a_second_without_a_switch():
    """No switch runs, so no arbiter is waiting on the proc: the always-on proc watch sees
    it die and the call ends with ReplicaLostError (Monarch alone takes about 7 s)."""
    async with start_runtime(gpus_per_host=1):
        service = await spawn_service(ServiceConfig(resource_group="solo"), MemoryTenant, 1,
                                      name="solo")
        replica = service.replicas[0]
        pid = (await pids(replica))[0]
        call = asyncio.ensure_future(replica.call("work", (1, 10.0), {}))
        await until(lambda: replica.in_flight)
        await asyncio.sleep(0.3)
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ReplicaLostError, match="proc watch"):
            await call
        seen = time.monotonic() - killed
        print(f"kill -> ReplicaLostError: {seen:.3f} s")
        assert seen < 1.5
        await until(lambda: replica.generation == 1 and replica.state is ReplicaState.HEALTHY)


def slot_procs() -> list[int]:
    """This process's descendants that are slot procs (started with COLOCATE_SLOT)."""
    import psutil

    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "COLOCATE_SLOT" in child.environ():
                found.append(child.pid)
        except psutil.Error:
            pass
    return found


async def test_a_shutdown_during_a_restart_ends_it_and_leaves_no_proc():
    from colocate import init

    rm = await init("local", 1, 2)
    try:
        trainer = await spawn_service(
            ServiceConfig(procs_per_host=2, resource_group="rl", restart="group"),
            MemoryTenant, 1, name="trainer")
        os.kill((await pids(trainer.replicas[0]))[0], signal.SIGKILL)
        await until(lambda: trainer.restarts.running)
        await asyncio.sleep(0.5)  # under way: new procs starting, or the trainer spawning
    finally:
        started = time.monotonic()
        await rm.shutdown()
    assert time.monotonic() - started < 30
    assert not trainer.restarts.running and trainer.restarts.events == []
    assert all(r.state is ReplicaState.STOPPED for r in trainer.replicas)
    await until(lambda: not slot_procs(), 10)
