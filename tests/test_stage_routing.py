"""Routing by the stages an endpoint needs (`colocate.needs`), under the budget policy where
a tenant may be partly awake: a call goes to a replica whose needed stages are awake while
its others sleep; a call needing a sleeping stage waits, wakes only that stage, or fails,
as `when_asleep` says; `phase(svc.<endpoint>)` wakes only the endpoint's stages. Real
Monarch procs on one CPU slot; two `DeclaredTenant` services of 8 MiB weights (kept) and
8 MiB cache (dropped) each, on a slot of 24 MiB: one fits whole beside the other's weights.
"""

from __future__ import annotations

import asyncio

import pytest

from colocate import ArbiterConfig, phase
from colocate.arbiter.host import HostView
from colocate.memory.traffic import Traffic
from colocate.resources.hosts_view import HostsView
from colocate.testing import DeclaredTenant, MemoryTenant, start_runtime
from services import ServiceAsleepError, ServiceConfig, spawn_service

pytestmark = pytest.mark.timeout(300)

MiB = 1 << 20
BUDGET = ArbiterConfig(policy="budget", slot_capacity_bytes=24 * MiB)
WHOLE = ["weights", "cache"]


def policy(svc, when_asleep: str, wait_timeout_s: float = 60.0) -> None:
    svc.config = ServiceConfig(**{**svc.config.__dict__, "when_asleep": when_asleep,
                                  "wait_timeout_s": wait_timeout_s})


async def pair(rm):
    """Services a and b on the slot: b whole and a's weights awake, its cache asleep (a
    sleeps first so that b fits as it starts, as it would on a full GPU)."""
    a = await spawn_service(ServiceConfig(resource_group="rl"), DeclaredTenant, 8, 1, name="a")
    await rm.sleep("a_r0")
    b = await spawn_service(ServiceConfig(resource_group="rl"), DeclaredTenant, 8, 2, name="b")
    await rm.wake("a_r0", ["weights"])  # it fits beside b: nothing of b sleeps
    assert await slot(rm) == {"a_r0": ["weights"], "b_r0": WHOLE}
    return a, b


async def slot(rm) -> dict:
    return (await rm.status())[0][0]


async def moved(rm):
    return (await rm.traffic())[0][0].moved


def test_the_view_keeps_each_tenants_stages_awake_on_all_its_slots():
    view = HostsView(measures=False)
    view.tenants = {"gen": [(0, 0), (0, 1)]}
    view.stages = {"gen": ("weights", "kv_cache")}

    def answer(seq: int, second: list[str] | None) -> None:
        view.record({0: HostView({0: {"gen": ["weights", "kv_cache"]}, 1: {"gen": second}},
                                 frozenset(), {}, seq=seq)})

    answer(1, ["weights"])
    assert view.awake_now("gen", ("weights",)) and not view.awake_now("gen")
    assert not view.awake_now("gen", ("kv_cache",)) and view.awake_tenants() == []
    # what a call needs of it: its own stages among those declared, in its wake order
    assert view.needed("gen", ("kv_cache", "weights", "optimizer")) == ("weights", "kv_cache")
    assert view.needed("gen", None) == ("weights", "kv_cache")
    answer(2, None)  # unknown after a failed rollback: nothing awake
    assert not view.awake_now("gen", ("weights",)) and view.awake_now("gen", ())
    answer(3, ["weights", "kv_cache"])
    assert view.awake_tenants() == ["gen"]
    view.switching["gen"] += 1  # a switch in flight may put it to sleep
    assert not view.awake_now("gen", ("weights",))


def test_a_view_older_than_the_one_kept_is_dropped():
    """Switches on other slots of a host run concurrently in its arbiter: the answer of
    one taken earlier may arrive after the answer of one taken later (kept, the stale view
    would say a tenant awake that had slept: its wake skipped, its call failing)."""
    view = HostsView(measures=True)
    view.tenants = {"a": [(0, 0)], "b": [(0, 1)]}
    view.stages = {"a": ("weights",), "b": ("weights",)}
    older = HostView({0: {"a": ["weights"]}, 1: {"b": []}}, frozenset(), {0: "a"}, seq=4)
    newer = HostView({0: {"a": []}, 1: {"b": ["weights"]}}, frozenset(), {1: "b"}, seq=5)
    view.record({0: newer})
    view.record({0: older})
    assert view.awake_tenants() == ["b"] and not view.awake_now("a")
    assert view.holders == {(0, 1): "b"}  # who holds a slot's working memory: the same
    view.record({0: HostView({0: {"a": ["weights"]}, 1: {"b": []}}, frozenset(), {}, seq=6)})
    assert view.awake_tenants() == ["a"]


async def test_a_call_goes_where_its_stages_are_awake_while_another_stage_sleeps():
    async with start_runtime(gpus_per_host=1, arbiter=BUDGET) as rm:
        a, b = await pair(rm)
        assert (a.read.stages(), a.fill.stages(), a.work.stages()) == (("weights",),
                                                                       ("cache",), None)
        assert a.read.tenant_names() == ["a_r0"]
        assert rm.routable("a_r0", ["weights"]) and not rm.routable("a_r0")
        assert rm.routable("a_r0", ["weights", "kv_cache"])  # a stage it lacks: ignored
        assert await a.read.route() == ["weights"]  # its cache sleeps; it is not needed
        assert await a.read.fanout() == [["weights"]]
        policy(a, "fail")
        with pytest.raises(ServiceAsleepError, match="'a' has no awake replica"):
            await a.fill.route(1.0)  # it needs the cache, asleep
        with pytest.raises(ServiceAsleepError):
            await a.work.route(1)  # undeclared: it needs every stage, as before
        assert await b.work.route(7) == 7 and await b.fill.route(2.0) == WHOLE
        assert await slot(rm) == {"a_r0": ["weights"], "b_r0": WHOLE}  # nothing switched
        counts = await a.replicas[0].actors.counts.call_one()
        assert counts["asleep"] == 0 and counts["awake"] == 0


async def test_when_asleep_waits_for_wakes_only_or_fails_on_the_stages_a_call_needs():
    async with start_runtime(gpus_per_host=1, arbiter=BUDGET) as rm:
        a, b = await pair(rm)
        policy(a, "wake")
        before = await moved(rm)
        assert await a.fill.route(3.0) == WHOLE  # a's cache woke; b's dropped for it
        assert await slot(rm) == {"a_r0": WHOLE, "b_r0": ["weights"]}
        assert (await moved(rm)).since(before).copied == 0  # weights stayed where they were
        policy(b, "wait", wait_timeout_s=0.3)
        with pytest.raises(ServiceAsleepError, match="no replica woke within 0.3 s"):
            await b.fill.route(4.0)
        assert await b.read.route() == ["weights"]  # its weights need no wait
        policy(b, "wait")
        waiting = asyncio.ensure_future(b.fill.route(5.0))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        async with phase(b.fill):  # wakes b's cache alone: the waiting call goes on
            assert await asyncio.wait_for(waiting, 30) == WHOLE
        assert await slot(rm) == {"a_r0": ["weights"], "b_r0": WHOLE}


async def test_phase_of_an_endpoint_wakes_only_the_stages_it_needs():
    async with start_runtime(gpus_per_host=1, arbiter=BUDGET) as rm:
        a, b = await pair(rm)
        with pytest.raises(TypeError, match="wakes the stages it needs"):
            phase(a.fill, stages=["cache"])
        before = await moved(rm)
        async with phase(a.read):  # its weights are awake: nothing moves
            assert await a.read.route() == ["weights"]
        assert (await moved(rm)).since(before) == Traffic()
        assert await slot(rm) == {"a_r0": ["weights"], "b_r0": WHOLE}
        async with phase(a.fill):
            assert await slot(rm) == {"a_r0": WHOLE, "b_r0": ["weights"]}
        async with phase(b.work):  # undeclared: every stage, as phase(b)
            assert await slot(rm) == {"a_r0": ["weights"], "b_r0": WHOLE}
        async with phase(a):
            assert await slot(rm) == {"a_r0": WHOLE, "b_r0": ["weights"]}
        with phase(b.fill):  # the blocking form too
            pass
        assert await slot(rm) == {"a_r0": ["weights"], "b_r0": WHOLE}


async def test_each_replica_counts_the_calls_it_served_and_failed():
    async with start_runtime(gpus_per_host=1) as rm:
        svc = await spawn_service(ServiceConfig(), MemoryTenant, 1, name="counted")
        await rm.wake(svc.tenant_names()[0])
        assert [await svc.work.route(i) for i in range(3)] == [0, 1, 2]
        with pytest.raises(ValueError, match="non-negative"):
            await svc.work.route(0, seconds=-1.0)  # the endpoint's own error
        replica = svc.replicas[0]
        assert (replica.served, replica.failed, replica.in_flight) == (3, 1, 0)
