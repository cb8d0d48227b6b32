"""The colocation runtime on real Monarch procs (CPU slots): groups, arbiters, switches."""

from __future__ import annotations

import asyncio
import os
import random
import signal

import psutil
import pytest
from monarch.actor import ActorError

from colocate.arbiter import SwitchError
from colocate.resources import zygote
from colocate.resources.listener import Listener
from colocate.resources.packing import ResourceError, ResourceRequest, ResourceValueError
from colocate.resources.procs import ProcProbe
from colocate.resources.start import init
from colocate.testing import FailingSleepTenant, MemoryTenant, start_runtime

MiB = 1 << 20
pytestmark = pytest.mark.timeout(300)


async def two_tenants(rm, group="rl", hosts=1, procs=2, mib=128, b_class=MemoryTenant):
    request = ResourceRequest(group, hosts=hosts, procs_per_host=procs)
    a = await rm.spawn("a", MemoryTenant, await rm.allocate(request, owner="a"), mib, 1)
    b = await rm.spawn("b", b_class, await rm.allocate(request, owner="b"), mib, 2)
    return a, b


def values(mesh_result):
    return [value for _, value in mesh_result.items()]


def assert_one_awake(status, awake: str):
    for host, slots in status.items():
        for slot, tenants in slots.items():
            if not tenants:
                continue  # a slot with no tenant
            assert [n for n, stages in tenants.items() if stages] == [awake], (host, slot, status)


async def switch_and_check(rm, a, b, mib: int):
    """a's memory (weights and cache: 2 * mib per proc) is released, measured in each proc;
    b takes its place, and b's weights come back intact."""
    await rm.wake("b")
    b_sums = values(await b.checksum.call())
    await rm.wake("a")
    before = values(await a.memory.call())
    await rm.sleep("a")
    asleep = values(await a.memory.call())
    await rm.wake("b")
    after = values(await b.memory.call())
    assert_one_awake(await rm.status(), "b")
    for x, y, z in zip(before, asleep, after, strict=True):
        assert x["pid"] == y["pid"] == z["pid"]  # a and b share each proc
        assert x["used"] - y["used"] >= 0.9 * 2 * mib * MiB, (x, y)
        assert abs(z["used"] - x["used"]) <= 0.1 * 2 * mib * MiB, (x, z)
    assert values(await b.checksum.call()) == b_sums
    with pytest.raises(ActorError, match="paused"):
        await a.checksum.call()


async def test_wake_releases_the_other_and_restores_contents():
    async with start_runtime(gpus_per_host=2) as rm:
        a, b = await two_tenants(rm, mib=128)
        group = rm.group("rl")
        assert sorted(slot for _, slot in rm.slots_of("a")) == [0, 1]
        probes = values(await group.procs.spawn("check", ProcProbe).info.call())
        assert sorted(p["slot"] for p in probes) == ["0", "1"]
        assert sorted(p["pid"] for p in probes) == sorted(group.pids)
        assert sorted(group.here) == sorted(group.pids)  # this machine's procs: signalled
        await switch_and_check(rm, a, b, mib=128)


async def test_two_hundred_alternations_do_not_drift():
    async with start_runtime(gpus_per_host=1) as rm:
        a, b = await two_tenants(rm, procs=1, mib=16)
        used = []
        for _ in range(200):
            await rm.wake("a")
            await rm.wake("b")
            await b.use_cache.call(1.0)
            used.append(values(await b.memory.call())[0]["used"])
        assert abs(used[-1] - used[0]) < 0.02 * used[0], (used[0], used[-1])


async def test_the_managers_view_follows_each_switch_and_skips_needless_ones():
    async with start_runtime(gpus_per_host=2) as rm:
        await two_tenants(rm, mib=8)  # a is awake: b went to sleep as it registered
        drained: list[set[str]] = []

        async def record(touched: set[str]) -> None:
            drained.append(set(touched))

        rm.listen(Listener(drain=record))
        for step, name in enumerate(["a", "b", "b", "a", "sleep a", "a", "a"]):
            if name == "sleep a":
                await rm.sleep("a")
            else:
                await rm.wake(name)
            assert rm.view.host_status == await rm.status(), step  # answers kept it
            assert rm.awake_tenants() == [n for n in "ab" if n == name], step
        # a wake of an awake tenant makes no switch; a sleep of a touches a, a wake of a b
        assert drained == [{"a"}, {"b"}, {"a"}, {"b"}]


async def test_concurrent_conflicting_wakes_never_leave_two_awake():
    async with start_runtime(gpus_per_host=2) as rm:
        await two_tenants(rm, mib=8)
        violations, samples, done = [], 0, asyncio.Event()

        async def watch():
            nonlocal samples
            while not done.is_set():
                for slots in (await rm.status()).values():
                    for tenants in slots.values():
                        if sum(1 for stages in tenants.values() if stages) > 1:
                            violations.append(tenants)
                samples += 1

        async def client(seed: int):
            rng = random.Random(seed)
            for _ in range(25):
                await rm.wake(rng.choice("ab"))

        watcher = asyncio.create_task(watch())
        await asyncio.gather(client(1), client(2))
        done.set()
        await watcher
        assert violations == [] and samples > 10


async def test_a_failing_sleep_is_reported_and_loses_no_tenant():
    async with start_runtime(gpus_per_host=1) as rm:
        a, b = await two_tenants(rm, procs=1, mib=8, b_class=FailingSleepTenant)
        await rm.wake("b")  # a sleeps (it can), b wakes
        with pytest.raises(SwitchError, match="b failed to sleep on slot 0: injected.*a was not"):
            await rm.wake("a")
        status = await rm.status()
        assert status == {0: {0: {"a": [], "b": ["weights", "cache"]}}}
        assert len(values(await b.checksum.call())) == 1  # b still works
        await rm.sleep("a")  # a is still registered and answers
        assert (await rm.status())[0][0]["a"] == []


async def test_second_service_of_a_group_shares_its_procs_and_misfits_fail_early():
    async with start_runtime(gpus_per_host=4) as rm:
        trainer = await rm.allocate(ResourceRequest("rl", 1, 4), owner="trainer")
        gen0 = await rm.allocate(ResourceRequest("rl", 1, 2), owner="gen")
        gen1 = await rm.allocate(ResourceRequest("rl", 1, 2), owner="gen")
        assert trainer.slots == ((0, 0), (0, 1), (0, 2), (0, 3))
        assert gen0.slots + gen1.slots == trainer.slots  # same procs, split in two replicas
        with pytest.raises(ResourceError, match="already uses every proc"):
            await rm.allocate(ResourceRequest("rl", 1, 2), owner="gen")
        with pytest.raises(ResourceError, match="has 1 host"):
            await rm.allocate(ResourceRequest("rl", 1, 8), owner="big")
        with pytest.raises(ResourceError, match="free now"):
            await rm.allocate(ResourceRequest("other", 1, 1), owner="x")


@pytest.mark.parametrize("scheduler", ["processes", "torchx:local_cwd"])
async def test_switches_across_two_hosts(scheduler):
    async with start_runtime(scheduler, hosts=2, gpus_per_host=2) as rm:
        a, b = await two_tenants(rm, hosts=2, procs=2, mib=32)
        assert sorted(rm.slots_of("b")) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        await switch_and_check(rm, a, b, mib=32)
        # forked, not started on their own: from this process's fork server for the
        # "processes" hosts (on this machine), from each host's own for colocate's workers
        servers = {psutil.Process(pid).parent() for pid in rm.group("rl").pids}
        if scheduler == "processes":
            assert {s.pid for s in servers} == {zygote.server_pid()}
        else:
            assert len(servers) == 2 and all(
                "colocate.resources.zygote" in s.cmdline()
                and "colocate.resources.worker" in s.parent().cmdline() for s in servers)


async def test_phase_wakes_for_its_block_in_both_forms(colocate_runtime):
    from colocate import phase

    rm = colocate_runtime  # the fixture users get: this machine's GPUs, or 2 virtual slots
    a, b = await two_tenants(rm, procs=1, mib=8)
    async with phase("b"):
        assert_one_awake(await rm.status(), "b")
        assert len(values(await b.checksum.call())) == 1
    assert_one_awake(await rm.status(), "b")  # stays awake after the block
    with phase("a"):  # the blocking form, here from inside a running loop
        assert_one_awake(await rm.status(), "a")
    with pytest.raises(TypeError, match="tenant names"):
        phase(42)


@pytest.mark.parametrize("gpus_per_host", [0, -1, "2", 1.5])
async def test_init_refuses_a_bad_slot_count_before_any_host_starts(gpus_per_host):
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ResourceValueError, match=rf"init: gpus_per_host={gpus_per_host!r}"):
        await init("processes", hosts=2, gpus_per_host=gpus_per_host)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children


async def test_phase_without_a_runtime_says_how_to_start_one():
    from colocate import phase

    with pytest.raises(ResourceError, match="no runtime is running"):
        async with phase("a"):
            pass


async def test_a_sleeping_tenant_says_how_to_wake_it_and_its_error_can_be_caught():
    from colocate import remote_errors
    from colocate.memory import TagPausedError

    async with start_runtime(gpus_per_host=1) as rm:
        request = ResourceRequest("rl", 1, 1)
        actor = await rm.spawn("actor", MemoryTenant, await rm.allocate(request, "actor"), 4)
        await rm.spawn("other", MemoryTenant, await rm.allocate(request, "other"), 4)
        await rm.wake("other")
        with pytest.raises(TagPausedError, match=r"tenant 'actor' is asleep.*"
                           r"phase\('actor'\).*rm\.wake\('actor'\)") as info:
            async with remote_errors():  # the runtime's own error, caught by its type
                await actor.checksum.call_one()
        assert "resume(" not in str(info.value)


async def test_usage_gives_each_tenants_bytes_per_slot():
    async with start_runtime(gpus_per_host=2) as rm:
        await two_tenants(rm, mib=8)
        await rm.wake("b")
        usage = await rm.usage()
        assert sorted(usage[0]) == [0, 1]
        pids = set()
        for slot in (0, 1):
            a, b = usage[0][slot]["a"], usage[0][slot]["b"]
            assert a.tagged_bytes == b.tagged_bytes == 2 * 8 * MiB  # weights + cache
            assert (a.resident_bytes, b.resident_bytes) == (0, 2 * 8 * MiB)
            assert (a.awake_stages, b.awake_stages) == ((), ("weights", "cache"))
            assert a.pid == b.pid
            pids.add(a.pid)
        assert len(pids) == 2  # one proc per slot, each answering for its own slot
        assert await rm.status() == {0: {s: {"a": [], "b": ["weights", "cache"]}
                                         for s in (0, 1)}}  # status keeps its shape
        os.kill(usage[0][0]["a"].pid, signal.SIGKILL)  # slot 0's proc dies
        usage = await rm.usage()
        assert usage[0][0] == {"a": None, "b": None}  # the other slot still answers
        assert usage[0][1]["b"].resident_bytes == 2 * 8 * MiB


def test_help_shows_a_tenants_endpoints_with_their_docstrings():
    import pydoc

    text = pydoc.render_doc(MemoryTenant, renderer=pydoc.plaintext)
    assert "endpoint checksum() -> 'str'" in text
    assert "The weights' SHA-256; raises TagPausedError while asleep." in text
    assert "endpoint use_cache(value: 'float') -> 'float'" in text
