"""The service layer on real Monarch procs: awake-only routing, policies, sessions."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from monarch.actor import endpoint

from colocate import needs, phase
from colocate.arbiter import TenantLostError
from colocate.resources.groups import Allocation
from colocate.resources.listener import Listener
from colocate.resources.packing import ResourceRequest
from colocate.testing import MemoryTenant, start_runtime
from services import (
    ServiceAsleepError,
    ServiceClosedError,
    ServiceConfig,
    ServiceConfigError,
    spawn_service,
    sync_weights,
)
from services.replica import Replica, ReplicaState, ReplicaStateError, tenant_name
from services.waiting import Changes

pytestmark = pytest.mark.timeout(300)


def test_config_errors_name_the_field_and_the_limit():
    cases = [
        (dict(min_replicas=3, max_replicas=2, num_replicas=2), "min_replicas=3 is above"),
        (dict(num_replicas=5, min_replicas=1, max_replicas=4), "num_replicas=5 is outside"),
        (dict(procs_per_host=0), "procs_per_host=0"),
        (dict(procs_per_host=2, procs_per_replica=2), "not both"),
        (dict(procs_per_replica=2, hosts_per_replica=2), "one-host replicas"),
        (dict(router="random"), "router='random'"),
        (dict(router="sticky"), "router='sticky'"),
        (dict(when_asleep="sleep"), "when_asleep='sleep'"),
        (dict(max_retries=-1), "max_retries=-1"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ServiceConfigError, match=message):
            ServiceConfig(**kwargs)
    with pytest.raises(ServiceConfigError, match="procs_per_host=9 is above the 8 GPUs"):
        ServiceConfig(procs_per_host=9).check_fits(num_hosts=1, gpus_per_host=8)
    with pytest.raises(ServiceConfigError, match="hosts_per_replica=2 is above the 1 host"):
        ServiceConfig(hosts_per_replica=2).check_fits(num_hosts=1, gpus_per_host=8)
    assert ServiceConfig(procs_per_replica=4).procs == 4


async def colocated(rm, when_asleep="wait", generators=2):
    trainer = await spawn_service(ServiceConfig(procs_per_host=2, resource_group="rl"),
                                  MemoryTenant, 8, 1, name="trainer")
    generator = await spawn_service(
        ServiceConfig(num_replicas=generators, procs_per_host=1, resource_group="rl",
                      when_asleep=when_asleep, router="least_loaded"),
        MemoryTenant, 8, 2, name="generator")
    return trainer, generator


async def test_no_request_reaches_a_sleeping_replica_while_phases_alternate():
    async with start_runtime(gpus_per_host=2) as rm:
        trainer, generator = await colocated(rm)
        stop = asyncio.Event()

        async def alternate():
            while not stop.is_set():
                for svc in (generator, trainer):
                    async with phase(svc):
                        await asyncio.sleep(0.05)

        async def client(svc, start: int, n: int):
            return [await svc.work.route(start + i) for i in range(n)]

        switching = asyncio.create_task(alternate())
        results = await asyncio.gather(*(client(generator, 1000 * c, 100) for c in range(8)),
                                       *(client(trainer, 100_000 + 1000 * c, 40)
                                         for c in range(4)))
        stop.set()
        await switching
        sent = [list(range(1000 * c, 1000 * c + 100)) for c in range(8)] + \
            [list(range(100_000 + 1000 * c, 100_000 + 1000 * c + 40)) for c in range(4)]
        assert results == sent  # every request answered, with its own answer
        counts = [c for svc in (generator, trainer) for r in svc.replicas
                  for _, c in (await r.actors.counts.call()).items()]
        assert all(c["asleep"] == 0 for c in counts), counts
        assert sum(c["awake"] for c in counts) == 8 * 100 + 4 * 40 * 2  # trainer: 2 procs


async def test_when_asleep_policies():
    async with start_runtime(gpus_per_host=2) as rm:
        trainer, generator = await colocated(rm, when_asleep="fail")
        await rm.wake(trainer.tenant_names()[0])
        with pytest.raises(ServiceAsleepError, match=r"'generator'.*awake now: trainer_r0\. "
                           r"Wake it.*async with phase\(service\).*when_asleep='wake'"):
            await generator.work.route(1)
        generator.config = ServiceConfig(**{**generator.config.__dict__, "when_asleep": "wake"})
        assert await generator.work.route(2) == 2  # woke a replica on demand
        assert rm.awake_tenants() == [generator.replicas[0].tenant]  # the trainer slept
        generator.config = ServiceConfig(**{**generator.config.__dict__, "when_asleep": "wait",
                                            "wait_timeout_s": 0.3})
        async with phase(trainer):
            with pytest.raises(ServiceAsleepError, match=r"no replica woke within 0.3 s.*"
                               r"async with phase\(service\)"):
                await generator.work.route(3)


async def test_a_waiting_call_is_woken_by_the_switch_not_by_polling():
    async with start_runtime(gpus_per_host=2) as rm:
        trainer, generator = await colocated(rm)
        await rm.wake(trainer.tenant_names()[0])
        looks = 0
        ready = generator._ready

        def counted(exclude: set[int]) -> list[Replica]:
            nonlocal looks
            looks += 1
            return ready(exclude)

        generator._ready = counted  # type: ignore[method-assign]
        call = asyncio.ensure_future(generator.work.route(5))
        await asyncio.sleep(0.5)
        assert not call.done() and looks == 1  # asleep: one look, then no polling
        async with phase(generator):
            assert await asyncio.wait_for(call, 10) == 5
        assert looks <= 4  # one more look per switch that ended


def test_a_replica_moves_only_along_its_states():
    changes = Changes()
    replica = Replica("gen_g2", 0, Allocation("rl", "gen_g2", None, ((0, 0),), 1, 1), changes)
    assert (replica.state, replica.tenant) == (ReplicaState.STARTING, "gen_g2_r0")
    for state in (ReplicaState.HEALTHY, ReplicaState.FAILED, ReplicaState.RECOVERING):
        replica.move(state, "proc died" if state is ReplicaState.FAILED else None)
    assert replica.failure == "proc died" and changes.version == 3  # each move is told
    replica.generation = 2
    replica.move(ReplicaState.HEALTHY)
    assert (replica.tenant, replica.generation, replica.failure) == ("gen_g2_r0_g2", 2, None)
    with pytest.raises(ReplicaStateError, match="replica 0 of service 'gen_g2' cannot go from "
                       "healthy to recovering"):
        replica.move(ReplicaState.RECOVERING)
    assert tenant_name("a-b-c", 3, 1) == "a-b-c_r3_g1"


async def test_sessions_stick_and_errors_reach_the_caller():
    async with start_runtime(gpus_per_host=2) as rm:
        _, generator = await colocated(rm)
        async with phase(generator):
            async with generator.session():
                pids = {(await generator.memory.route())["pid"] for _ in range(10)}
            assert len(pids) == 1
            everywhere = await generator.memory.fanout()
            assert len({m["pid"] for m in everywhere}) == 2
            with pytest.raises(TypeError):
                await generator.use_cache.route("not a number")
            assert all(r.state is ReplicaState.HEALTHY for r in generator.replicas)
            await generator.shutdown()
            with pytest.raises(ServiceClosedError):
                await generator.work.route(1)
            with pytest.raises(AttributeError, match="no endpoint 'nope'"):
                generator.nope  # noqa: B018
            with pytest.raises(AttributeError, match="no endpoint 'wrk'; did you mean 'work'"):
                generator.wrk  # noqa: B018
            with pytest.raises(AttributeError, match=r"supports route\(\) .* and fanout\(\)"):
                generator.work.call_one(1)


async def test_a_session_is_a_block_per_service_and_per_task():
    """Inside `async with svc.session():` the routes go to one replica with no argument;
    concurrent tasks in sessions of their own keep to their own; outside, round robin as
    before; another service's session nested inside leaves the outer one be."""
    async with start_runtime(gpus_per_host=4):
        a, b = [await spawn_service(ServiceConfig(num_replicas=2, procs_per_host=1,
                                                  resource_group=name, router="round_robin"),
                                    MemoryTenant, 1, name=name) for name in ("a", "b")]

        async def pids(svc, n: int = 6) -> list[int]:
            return [(await svc.memory.route())["pid"] for _ in range(n)]

        assert len(set(await pids(a))) == 2  # no session: round robin over both
        async with a.session() as in_a:
            assert (a.router.current(), b.router.current()) == (in_a, None)
            mine = set(await pids(a))
            assert len(mine) == 1
            async with b.session() as in_b:
                assert (a.router.current(), b.router.current()) == (in_a, in_b)
                assert len(set(await pids(b))) == 1
                assert set(await pids(a)) == mine  # b's session leaves a's be
            assert b.router.current() is None and len(set(await pids(b))) == 2
            assert set(await pids(a)) == mine
        assert a.router.current() is None and a.router.sessions == {} == b.router.sessions
        assert len(set(await pids(a))) == 2

        async def own_session() -> list[int]:
            async with a.session():
                return await pids(a, 10)

        seen = await asyncio.gather(*(own_session() for _ in range(2)))
        assert [len(set(s)) for s in seen] == [1, 1] and seen[0][0] != seen[1][0]
        assert a.router.sessions == {}


async def test_a_killed_replica_loses_no_request_and_comes_back():
    async with start_runtime(gpus_per_host=2) as rm:
        supervised: list[str] = []
        rm.listen(Listener(failed=lambda name, why: supervised.append(name)))
        generator = await spawn_service(
            ServiceConfig(num_replicas=2, procs_per_host=1, resource_group="gen",
                          router="round_robin"), MemoryTenant, 8, 2, name="generator")
        victim = generator.replicas[0]
        pid = (await victim.actors.memory.call_one())["pid"]

        async def client(start: int):
            out = []
            for i in range(60):
                out.append(await generator.work.route(start + i))
                await asyncio.sleep(0.01)
            return out

        # the clients start outside the session: a task started inside would be in it
        clients = [asyncio.create_task(client(1000 * c)) for c in range(4)]
        async with generator.session() as session:  # a session on the replica to kill
            while generator.router.sessions.get(session) != victim.index:
                generator.router.sessions.pop(session, None)  # picked anew (end() ends it)
                await generator.work.route(0)
            await asyncio.sleep(0.2)
            os.kill(pid, signal.SIGKILL)
            for _ in range(1000):
                if victim.state is not ReplicaState.HEALTHY:
                    break
                await asyncio.sleep(0.01)
            assert await generator.work.route(5) == 5
            assert generator.router.sessions[session] == 1  # the session moved
            results = await asyncio.gather(*clients)
        assert results == [list(range(1000 * c, 1000 * c + 60)) for c in range(4)]
        await back(victim)
        assert victim.allocation.slots == ((0, 0),)
        new_pid = (await victim.actors.memory.call_one())["pid"]
        assert new_pid != pid
        for _ in range(100):  # Monarch's supervision reports it too, not only the call
            if "generator_r0" in supervised:
                break
            await asyncio.sleep(0.1)
        assert supervised == ["generator_r0"]
        assert victim.tenant == "generator_r0_g1" and not rm.routable("generator_r0")
        answers = await asyncio.gather(*(generator.work.route(i) for i in range(10)))
        assert answers == list(range(10))
        assert (await victim.actors.counts.call_one())["awake"] > 0  # it serves again


async def test_a_proc_found_dead_in_a_switch_fails_its_replicas_at_once():
    """A killed proc shared by a trainer rank and generator replica 0: the switch that finds
    it dead marks both failed at once (the arbiter's report, not Monarch's, which comes
    seconds later), and `phase(generator)` still wakes replica 1 before it raises."""
    async with start_runtime(gpus_per_host=2) as rm:
        generator = await spawn_service(
            ServiceConfig(num_replicas=2, procs_per_host=1, resource_group="rl",
                          respawn=False), MemoryTenant, 8, name="generator")
        trainer = await spawn_service(
            ServiceConfig(procs_per_host=2, resource_group="rl", respawn=False),
            MemoryTenant, 8, name="trainer")
        await rm.wake(trainer.tenant_names()[0])
        # the always-on proc watch would race the switch to the dead proc (it polls every
        # 0.1 s; test_group_restart covers it): stopped, the switch alone can find it
        await rm.proc_watch.stop()
        os.kill((await generator.replicas[0].actors.memory.call_one())["pid"], signal.SIGKILL)
        await asyncio.sleep(0.5)  # longer than the proc watch's poll: it would have won
        with pytest.raises(TenantLostError, match="lost on slot 0") as lost:
            await phase(generator).__aenter__()
        assert set(lost.value.tenants) == {"generator_r0", "trainer_r0"}
        await asyncio.sleep(0.01)  # the services hear of it on their loop
        for replica in (generator.replicas[0], trainer.replicas[0]):
            assert replica.state is ReplicaState.FAILED
            assert "lost on slot 0" in replica.failure  # the arbiter's word came first
        assert rm.routable("generator_r1")
        assert await generator.work.route(7) == 7


async def test_a_call_in_a_dead_proc_does_not_hold_a_switch():
    """A call running in a proc that dies: the switch that drains its replica finds the proc
    dead (the arbiters' liveness check while the drain waits), the replica fails at once,
    and the call is retried on the other replica instead of waiting for Monarch."""
    async with start_runtime(gpus_per_host=2) as rm:
        generator = await spawn_service(
            ServiceConfig(num_replicas=2, procs_per_host=1, resource_group="rl",
                          respawn=False, router="round_robin"), MemoryTenant, 8,
            name="generator")
        trainer = await spawn_service(
            ServiceConfig(procs_per_host=2, resource_group="rl", respawn=False),
            MemoryTenant, 8, name="trainer")
        victim = generator.replicas[0]
        async with phase(generator):
            pid = (await victim.actors.memory.call_one())["pid"]
            call = asyncio.create_task(generator.work.route(7, 3.0))
            while victim.in_flight == 0:
                await asyncio.sleep(0.001)
        await asyncio.sleep(0.2)  # running in the victim's proc now
        await rm.proc_watch.stop()  # else it races the drain to the dead proc (see above)
        os.kill(pid, signal.SIGKILL)
        await asyncio.sleep(0.5)  # longer than the proc watch's poll: it would have won
        with pytest.raises(TenantLostError):
            async with phase(trainer):  # drains the victim first
                pass
        assert victim.state is ReplicaState.FAILED
        assert "liveness check" in victim.failure  # the arbiter's word, before Monarch's
        async with phase(generator):
            assert await asyncio.wait_for(call, 60) == 7  # retried on replica 1


async def test_a_phase_made_before_a_respawn_wakes_the_new_generation():
    async with start_runtime(gpus_per_host=1) as rm:
        generator = await spawn_service(ServiceConfig(procs_per_host=1, resource_group="rl"),
                                        MemoryTenant, 1, name="generator")
        await rm.spawn("b", MemoryTenant, await rm.allocate(ResourceRequest("rl"), "b"), 1)
        to_generator = phase(generator)
        assert generator.lose(generator.replicas[0], RuntimeError("its proc is gone"))
        await back(generator.replicas[0])
        await rm.wake("b")
        async with to_generator:
            assert rm.awake_tenants() == ["generator_r0_g1"]


async def back(replica: Replica, generation: int = 1) -> None:
    """Wait (at most 60 s) until `replica` is healthy again in its `generation`."""
    for _ in range(600):  # the replica comes back on a new proc for the same slot
        if replica.state is ReplicaState.HEALTHY and replica.generation == generation:
            break
        await asyncio.sleep(0.1)
    assert replica.generation == generation, replica.failure
    assert replica.state is ReplicaState.HEALTHY, replica.failure


async def test_autoscaling_goes_up_under_load_and_down_when_idle():
    async with start_runtime(gpus_per_host=3):
        config = ServiceConfig(num_replicas=1, min_replicas=1, max_replicas=3,
                               procs_per_host=1, resource_group="gen",
                               scale_up_queue_depth=2, scale_cooldown_s=0.5,
                               scale_down_utilization=0.05)
        generator = await spawn_service(config, MemoryTenant, 1, 2, name="generator")
        scaler = generator.autoscaler
        assert scaler is not None

        async def client(start: int):
            return [await generator.work.route(start + i, 0.05) for i in range(40)]

        results = await asyncio.gather(*(client(1000 * c) for c in range(12)))
        assert results == [list(range(1000 * c, 1000 * c + 40)) for c in range(12)]
        peak = max(count for _, count, _ in scaler.history)
        assert peak >= 2, scaler.history
        for _ in range(100):  # idle: back down to min_replicas
            if len(scaler.live()) == 1:
                break
            await asyncio.sleep(0.1)
        assert len(scaler.live()) == 1, scaler.history
        assert all(1 <= count <= 3 for _, count, _ in scaler.history)
        assert await generator.work.route(7) == 7
        await generator.shutdown()


async def test_names_like_generations_or_ids_respawn_as_themselves():
    """A replica's identity is kept in fields, never read back from names: services named
    with "_g<n>", "-" and "_<n>" are respawned after a kill, twice, each as itself."""
    async with start_runtime(gpus_per_host=3) as rm:
        names = ("gen_g2", "a-b-c", "trainer_1")
        services = [await spawn_service(ServiceConfig(procs_per_host=1, resource_group=name),
                                        MemoryTenant, 1, 2, name=name) for name in names]
        for generation in (1, 2):
            for svc in services:
                os.kill((await svc.replicas[0].actors.memory.call_one())["pid"], signal.SIGKILL)
            for svc in services:
                assert await svc.work.route(generation) == generation  # retried once back
                await back(svc.replicas[0], generation)
                assert svc.replicas[0].tenant == f"{svc.name}_r0_g{generation}"
        assert rm.awake_tenants() == sorted(f"{name}_r0_g2" for name in names)


class Exporter(MemoryTenant):
    """A trainer that exports a token for weights."""

    @endpoint
    @needs("weights")
    def export_weights(self) -> str:
        return "exported"


class Loader(MemoryTenant):
    """A generator whose load needs only its weights awake."""

    @endpoint
    @needs("weights")
    def load_exported(self, manifest: str) -> int:
        self.tenancy.ensure_stage("weights")
        return len(manifest)


@pytest.mark.usefixtures("procs_import_tests")
async def test_a_weight_load_wakes_only_the_stages_it_needs():
    """A generator asleep beside another tenant, synced through shared memory: the sync
    wakes the stages its `load_exported` declares (weights), and its cache sleeps on."""
    async with start_runtime(gpus_per_host=2) as rm:
        trainer = await spawn_service(ServiceConfig(resource_group="train"), Exporter, 1,
                                      name="trainer")
        generator = await spawn_service(ServiceConfig(resource_group="gen"), Loader, 1,
                                        name="generator")
        await rm.spawn("other", MemoryTenant, await rm.allocate(ResourceRequest("gen"), "other"),
                       1)
        await rm.wake("other")  # the generator sleeps
        report = await sync_weights(trainer, generator)
        assert report.shared_memory == {"generator_r0": len("exported")}
        host, slot = generator.replicas[0].allocation.slots[0]
        assert (await rm.status())[host][slot]["generator_r0"] == ["weights"]
