"""A wake that does not fit is not a crash: a CPU slot's capacity refuses tagged memory past
it (as a GPU's memory would), nothing of the refused allocation is kept, and the arbiter
learns the larger need and makes the room (`SlotArbiter.make_room`). Each scenario runs
in a fresh process: the capacity is the process's."""

from __future__ import annotations

import asyncio

import pytest
import torch

from colocate import memory
from colocate.arbiter import ArbiterConfig, SlotArbiter, SwitchError, TaggedTenant
from colocate.arbiter.local import LocalTenantHandle
from colocate.memory.capacity import from_cuda_oom

MiB = 1 << 20


def refusal_scenario() -> dict:
    memory.set_capacity(12 * MiB)
    out = {}
    with memory.region("a/weights", backup=True, device="cpu"):
        kept = torch.ones(8 * MiB // 4)
    try:
        with memory.region("a/scratch", device="cpu"):
            scratch = torch.ones(8 * MiB // 4)  # 16 MiB in all: past 12
        del scratch
    except memory.SlotOutOfMemoryError as err:
        out["region"] = (str(err), err.asked_bytes, err.free_bytes)
    out["scratch_tagged"] = "a/scratch" in memory.tags() and memory.tagged_bytes("a/scratch")
    loose = torch.ones(8 * MiB // 4)
    try:
        memory.adopt(loose, "a/loose")
    except memory.SlotOutOfMemoryError as err:
        out["adopt"] = (err.asked_bytes, err.free_bytes)
    out["loose_tagged"] = "a/loose" in memory.tags() and memory.tagged_bytes("a/loose")
    memory.pause("a/weights")  # paused memory is not held: now it fits
    memory.adopt(loose, "a/loose")
    out["after_pause"] = memory.tagged_bytes("a/loose")
    with pytest.raises(memory.SlotOutOfMemoryError, match="the state: 9437184 bytes asked"):
        memory.ensure_room(9 * MiB, "the state")
    out["kept_intact"] = (memory.resume("a/weights"), float(kept.sum()))[1] == kept.numel()
    return out


def test_a_cpu_slot_refuses_memory_past_its_capacity_and_keeps_nothing_of_it(isolated):
    out = isolated(refusal_scenario)
    message, asked, free = out["region"]
    assert asked == 8 * MiB and free == 4 * MiB
    assert "tag 'a/scratch': 8388608 bytes asked but only 4194304 of the slot's" in message
    assert "make room" in message
    assert not out["scratch_tagged"] and not out["loose_tagged"]
    assert out["adopt"] == (8 * MiB, 4 * MiB)
    assert out["after_pause"] == 8 * MiB
    assert out["kept_intact"]


def make(name: str, mib: int, seed: int, scratch: bool = False
         ) -> tuple[TaggedTenant, torch.Tensor]:
    stages = {"weights": f"{name}/weights", **({"scratch": f"{name}/scratch"} if scratch
                                               else {})}
    tenant = TaggedTenant(stages, backup={"weights": True, "scratch": False}, name=name)
    with tenant.region("weights", device="cpu"):
        weights = torch.full((mib * MiB // 4,), float(seed))
    return tenant, weights


def under_declared_scenario() -> dict:
    """`greedy` declares no working memory but its call takes 8 MiB of scratch."""
    async def run():
        memory.set_capacity(20 * MiB)
        greedy, _ = make("greedy", 4, 1, scratch=True)
        other, other_weights = make("other", 8, 2)
        arbiter = SlotArbiter([0], ArbiterConfig(policy="budget",
                                                 slot_capacity_bytes=20 * MiB))
        await arbiter.register(0, LocalTenantHandle("greedy", greedy))
        await arbiter.register(0, LocalTenantHandle("other", other))
        out = {"both": arbiter.status()[0]}

        def call() -> None:  # the tenant's call: its working memory, tagged
            with greedy.region("scratch", device="cpu"):
                scratch = torch.zeros(12 * MiB // 4)
            del scratch

        try:
            call()
        except memory.SlotOutOfMemoryError as err:
            out["first"] = (err.asked_bytes, err.free_bytes)
            await arbiter.make_room("greedy", err.asked_bytes)
        out["after_room"] = arbiter.status()[0]
        call()  # tried again: it fits now
        out["learned"] = arbiter.slots[0].extra_need["greedy"]
        await arbiter.wake("other")
        await arbiter.wake("greedy")  # the need it learned: the room is made ahead
        out["woken_again"] = arbiter.status()[0]
        out["other_intact"] = float(other_weights[0])  # asleep: read after its wake
        await arbiter.wake("other")
        out["other_intact"] = float(other_weights[0])
        try:
            await arbiter.make_room("greedy", 64 * MiB)  # can never fit
        except SwitchError as err:
            out["too_much"] = str(err)
        out["after_too_much"] = arbiter.status()[0]
        return out

    return asyncio.run(run())


def test_a_tenant_that_under_declares_gets_room_made_and_the_need_learned(isolated):
    out = isolated(under_declared_scenario)
    assert out["both"] == {"greedy": ["weights", "scratch"], "other": ["weights"]}
    assert out["first"] == (12 * MiB, 8 * MiB)  # 20 - 4 - 8 held
    assert out["after_room"] == {"greedy": ["weights", "scratch"], "other": []}
    assert out["learned"] == 12 * MiB  # it declared none
    assert out["woken_again"]["other"] == []
    assert out["other_intact"] == 2.0
    assert "greedy cannot wake on slot 0: it needs" in out["too_much"]
    assert out["after_too_much"]["other"] == ["weights"]  # nothing moved for it


def test_cuda_out_of_memory_reads_as_the_slots_refusal():
    err = from_cuda_oom(RuntimeError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
        "79.10 GiB of which 1.25 GiB is free. Including non-PyTorch memory..."))
    assert isinstance(err, memory.SlotOutOfMemoryError)
    assert (err.asked_bytes, err.free_bytes) == (2 << 30, int(1.25 * (1 << 30)))
    assert from_cuda_oom(RuntimeError("CUDA out of memory")).asked_bytes == 0


async def test_a_routed_call_that_runs_out_of_memory_gets_room_made_once():
    from colocate import phase
    from colocate.testing import MemoryTenant, ScratchTenant, start_runtime
    from services import ServiceConfig, spawn_service

    budget = ArbiterConfig(policy="budget", slot_capacity_bytes=40 * MiB)
    async with start_runtime(gpus_per_host=1, arbiter=budget) as rm:
        greedy = await spawn_service(ServiceConfig(resource_group="rl"), ScratchTenant, 8, 1,
                                     name="greedy")
        other = await spawn_service(ServiceConfig(resource_group="rl"), MemoryTenant, 8, 2,
                                    name="other")
        before = await other.checksum.route()
        # 32 MiB held of 40: 12 more do not fit until other's cache (8, dropped) sleeps
        assert await greedy.scratch.route(12) == 12 * MiB / 4
        status = (await rm.status())[0][0]
        assert status["other_r0"] == ["weights"] and "scratch" in status["greedy_r0"]
        moved = (await rm.traffic())[0][0].moved
        assert moved.copied == 0 and moved.discarded == 8 * MiB
        async with phase(other):  # woken whole again: nothing of it was lost
            assert await other.checksum.route() == before
        with pytest.raises(memory.SlotOutOfMemoryError) as caught:
            await greedy.scratch.route(64)  # more than the slot: no room can be made
        text = str(caught.value)
        assert "service 'greedy': greedy_r0 asked for 67108864 bytes" in text
        assert "no room could be made" in text
        assert (await rm.status())[0][0]["other_r0"] == ["weights", "cache"]  # none moved
        assert await other.checksum.route() == before
