"""The budget policy per stage: what sleeps for a wake is chosen stage by stage, cheapest
first (dropped before copied, then the fewest bytes copied), everything that fits stays
awake, and the handoff moves only what the slot lacks. Real tags in one process (the
arbiter's own tenants), each scenario in a fresh process."""

from __future__ import annotations

import asyncio

import pytest
import torch

from colocate import memory
from colocate.arbiter import ArbiterConfig, SlotArbiter, SwitchError, TaggedTenant
from colocate.arbiter.local import LocalTenantHandle
from colocate.arbiter.policy import Budget, Exclusive, Resident

MiB = 1 << 20


def test_discards_go_first_then_the_fewest_bytes_copied() -> None:
    resident = [Resident("trainer", "grads", 10, copied=False),
                Resident("trainer", "optimizer", 20, copied=True),
                Resident("trainer", "weights", 10, copied=True)]
    budget = Budget()
    assert budget.to_sleep("gen", resident, 15, 20) == []  # it fits: nothing sleeps
    assert budget.to_sleep("gen", resident, 15, 5) == resident[:1]  # a discard is enough
    # 20 short after the discard: the optimizer alone (20) copies less than both (30)
    assert budget.to_sleep("gen", resident, 35, 5) == resident[:2]
    # 10 short after the discard: the weights (10) copy less than the optimizer (20)
    assert budget.to_sleep("gen", resident, 25, 5) == [resident[0], resident[2]]
    # ties go to the order given: the optimizer state before the weights
    even = [Resident("t", "optimizer", 10, True), Resident("t", "weights", 10, True)]
    assert budget.to_sleep("gen", even, 5, 0) == even[:1]
    assert Budget(headroom_bytes=5).to_sleep("gen", even, 5, 0) == even[:1]
    assert Budget(headroom_bytes=6).to_sleep("gen", even, 5, 0) == even
    assert budget.to_sleep("gen", resident, 50, 5) == []  # even all would not do: none
    assert Exclusive().to_sleep("gen", [*resident, Resident("gen", "kv", 1, False)], 0,
                                None) == resident


def make(name: str, sizes: dict[str, int], kept: set[str], working_mib: int = 0):
    """A tenant with one tag per stage of `sizes` (MiB), filled with its seed."""
    tenant = TaggedTenant({s: f"{name}/{s}" for s in sizes},
                          backup={s: s in kept for s in sizes}, name=name,
                          working_bytes=working_mib * MiB)
    held = []
    for i, (stage, mib) in enumerate(sizes.items()):
        with tenant.region(stage, device="cpu"):
            held.append(torch.full((mib * MiB // 4,), float(i + 1)))
    return tenant, held


TRAINER = {"weights": 8, "optimizer": 16, "grads": 8}  # AdamW: moments twice the weights
GEN = {"weights": 8}


def rl_slot_scenario(capacity_mib: int) -> dict:
    """A trainer (weights, optimizer kept; grads dropped) and a generator whose weights the
    sync overwrites (dropped) and which works in 4 MiB, through one RL step's switches."""
    async def run():
        trainer, t_held = make("trainer", TRAINER, {"weights", "optimizer"})
        gen, g_held = make("gen", GEN, set(), working_mib=4)
        gen.sleep()
        arbiter = SlotArbiter([0], ArbiterConfig(policy="budget",
                                                 slot_capacity_bytes=capacity_mib * MiB))
        await arbiter.register(0, LocalTenantHandle("trainer", trainer))
        await arbiter.register(0, LocalTenantHandle("gen", gen, receiver=gen_receiver(g_held)))
        out = {}
        for phase in ("handoff", "generate", "train", "handoff2"):
            before = arbiter.traffic()[0].moved
            if phase.startswith("handoff"):
                out[f"{phase}_copied"] = await arbiter.handoff("trainer", "gen")
            else:
                await arbiter.wake("gen" if phase == "generate" else "trainer")
            out[phase] = arbiter.status()[0]
            out[f"{phase}_moved"] = arbiter.traffic()[0].moved.since(before)
        out["slept"] = arbiter.traffic()[0].slept
        out["peak"] = arbiter.traffic()[0].peak_bytes
        out["gen_weights"] = float(g_held[0][0])  # the sync's
        await arbiter.wake("trainer")
        # what is kept comes back (the gradients are dropped at a sleep)
        out["trainer_intact"] = [float(t[0]) for t in t_held[:2]] == [1.0, 2.0]
        return out

    return asyncio.run(run())


def gen_receiver(g_held):
    """The generator's receive: the trainer's weights (all 1.0) copied into its own."""
    def receive(source: str) -> int:
        g_held[0].fill_(1.0)
        return g_held[0].nbytes
    return receive


def test_with_ample_memory_nothing_moves_and_both_stay_awake(isolated):
    out = isolated(rl_slot_scenario, 64)
    everything = {"trainer": ["weights", "optimizer", "grads"], "gen": ["weights"]}
    for phase in ("handoff", "generate", "train", "handoff2"):
        assert out[phase] == everything, phase
        assert out[f"{phase}_moved"] == memory.Traffic(), phase
    assert out["handoff_copied"] == 8 * MiB  # the sync itself, in place
    assert out["slept"] == {}
    assert out["trainer_intact"] and out["gen_weights"] == 1.0
    assert 0 < out["peak"] <= 64 * MiB


def test_at_the_edge_only_what_needs_no_copy_sleeps(isolated):
    # 36 MiB: the trainer (32) and the generator's weights (8) and working memory (4) do
    # not fit together; dropping the trainer's gradients (8) is enough
    out = isolated(rl_slot_scenario, 36)
    assert out["handoff"] == {"trainer": ["weights", "optimizer"], "gen": ["weights"]}
    for phase in ("handoff", "generate", "handoff2"):
        assert out[f"{phase}_moved"].copied == 0, phase
    assert out["handoff_moved"].discarded == 8 * MiB
    # the trainer's wake takes its gradients back: the generator's weights are dropped
    assert out["train"] == {"trainer": ["weights", "optimizer", "grads"], "gen": []}
    assert out["train_moved"] == memory.Traffic(discarded=8 * MiB)
    assert out["trainer_intact"] and out["gen_weights"] == 1.0
    assert out["peak"] <= 36 * MiB


def test_when_a_copy_is_needed_the_fewest_bytes_cross(isolated):
    # 32 MiB: the trainer's weights must be awake beside the generator's for the copy (its
    # gradients are dropped for them); then the generator's working memory (4) needs 4 more:
    # the trainer's weights (8) are copied out, not its optimizer state (16)
    out = isolated(rl_slot_scenario, 32)
    assert out["handoff"] == {"trainer": ["optimizer"], "gen": ["weights"]}
    assert out["handoff_moved"] == memory.Traffic(copied_out=8 * MiB, discarded=8 * MiB)
    assert out["generate_moved"] == memory.Traffic()  # awake already, and holding the slot
    # training needs the whole trainer (32): the generator's weights are dropped, and the
    # trainer's weights come back
    assert out["train"]["trainer"] == ["optimizer", "weights", "grads"]
    assert out["train_moved"].copied_in == 8 * MiB
    assert out["trainer_intact"] and out["gen_weights"] == 1.0
    assert out["slept"]["trainer", "weights"] == 2
    assert out["peak"] <= 32 * MiB


def test_a_wake_that_cannot_fit_fails_naming_the_bytes_and_rolls_back(isolated):
    out = isolated(too_small_scenario)
    assert "gen cannot wake on slot 0: it needs" in out["error"]
    assert "but only" in out["error"] and "are free" in out["error"]
    assert out["after"] == {"trainer": ["weights", "optimizer", "grads"], "gen": []}
    assert out["moved"] == memory.Traffic()  # it could never fit: nothing moved for it
    assert out["trainer_intact"]


def too_small_scenario() -> dict:
    async def run():
        trainer, t_held = make("trainer", TRAINER, {"weights", "optimizer"})
        gen, _ = make("gen", {"weights": 40}, set())
        gen.sleep()
        arbiter = SlotArbiter([0], ArbiterConfig(policy="budget",
                                                 slot_capacity_bytes=36 * MiB))
        await arbiter.register(0, LocalTenantHandle("trainer", trainer))
        await arbiter.register(0, LocalTenantHandle("gen", gen))
        out = {}
        with pytest.raises(SwitchError) as caught:
            await arbiter.wake("gen")
        out["error"] = str(caught.value)
        out["after"] = arbiter.status()[0]
        out["moved"] = arbiter.traffic()[0].moved
        out["trainer_intact"] = [float(t[0]) for t in t_held] == [1.0, 2.0, 3.0]
        return out

    return asyncio.run(run())


class SleepFailsOnce(LocalTenantHandle):
    """A tenant whose first sleep raises (a fault in its endpoint)."""

    failed = False

    async def sleep(self, stages=None) -> int:
        if not self.failed:
            self.failed = True
            raise RuntimeError("injected sleep fault")
        return await super().sleep(stages)


def test_a_wake_that_failed_to_take_the_slot_does_not_hold_it(isolated):
    # a and b (8 MiB each) awake on 20 MiB; b works in 8 MiB, so holding the slot for its
    # calls sleeps a. a's sleep fails once: the slot rolls back, and b, though awake, did
    # not take it; the next wake of b makes the room (before, b was taken as holding it
    # and the wake did nothing)
    out = isolated(failed_hold_scenario)
    assert out["before"] == {"a": ["weights"], "b": ["weights"]}
    assert "injected sleep fault" in out["error"]
    assert out["failed"] == out["before"]
    assert out["after"] == {"a": [], "b": ["weights"]}


def failed_hold_scenario() -> dict:
    async def run():
        a, a_held = make("a", {"weights": 8}, {"weights"})
        b, b_held = make("b", {"weights": 8}, set(), working_mib=8)
        arbiter = SlotArbiter([0], ArbiterConfig(policy="budget",
                                                 slot_capacity_bytes=20 * MiB))
        await arbiter.register(0, SleepFailsOnce("a", a))
        await arbiter.register(0, LocalTenantHandle("b", b))
        out = {"before": arbiter.status()[0]}
        with pytest.raises(SwitchError) as caught:
            await arbiter.wake("b")
        out["error"] = str(caught.value)
        out["failed"] = arbiter.status()[0]
        await arbiter.wake("b")
        out["after"] = arbiter.status()[0]
        del a_held, b_held  # held until here: the tags count them
        return out

    return asyncio.run(run())
