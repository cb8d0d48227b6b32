"""The arbiter's logic with real tenants (real memory tags) in one plain process.

Each scenario runs in a fresh process: its RSS is the slot's measured memory.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import sys

import pytest
import torch

from colocate import memory
from colocate.arbiter import (
    ArbiterConfig,
    ArbiterError,
    ReleaseNotVerifiedError,
    SlotArbiter,
    SwitchError,
    TaggedTenant,
)
from colocate.arbiter.local import LocalTenantHandle
from colocate.arbiter.policy import POLICIES

MiB = 1 << 20


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()


def make_tenant(name: str, mib: int, seed: int, cache_mib: int = 0, backup: bool = True):
    stages = {"weights": f"{name}/weights"}
    if cache_mib:
        stages["kv_cache"] = f"{name}/kv_cache"
    tenant = TaggedTenant(stages, backup={"weights": backup, "kv_cache": False})
    g = torch.Generator().manual_seed(seed)
    with tenant.region("weights", device="cpu"):
        weights = torch.randint(0, 2**31, (mib * MiB // 4,), dtype=torch.int32, generator=g)
    cache = None
    if cache_mib:
        with tenant.region("kv_cache", device="cpu"):
            cache = torch.ones(cache_mib * MiB // 4)
    return tenant, weights, cache


def switch_scenario() -> dict:
    async def run():
        arbiter = SlotArbiter([0])
        a, a_weights, _ = make_tenant("a", 128, seed=1)
        b, b_weights, _ = make_tenant("b", 128, seed=2)
        a_digest, b_digest = _digest(a_weights), _digest(b_weights)
        await arbiter.register(0, LocalTenantHandle("a", a))
        await arbiter.register(0, LocalTenantHandle("b", b))  # b is put to sleep
        out = {"after_register": arbiter.status()[0], "a_bytes": memory.resident_bytes("a/weights")}
        await arbiter.wake("b")
        out["a_resident_after_wake_b"] = memory.resident_bytes("a/weights")
        out["b_identical"] = _digest(b_weights) == b_digest
        out["status"] = arbiter.status()[0]
        await arbiter.wake("a")
        out["a_identical"] = _digest(a_weights) == a_digest
        return out

    return asyncio.run(run())


def test_wake_sleeps_the_other_and_keeps_contents(isolated):
    out = isolated(switch_scenario)
    assert out["after_register"] == {"a": ["weights"], "b": []}
    assert out["a_bytes"] == 128 * MiB
    assert out["a_resident_after_wake_b"] == 0
    assert out["b_identical"]
    assert out["status"] == {"a": [], "b": ["weights"]}
    assert out["a_identical"]


def alternation_scenario(rounds: int) -> dict:
    async def run():
        import psutil

        arbiter = SlotArbiter([0])
        a, a_weights, _ = make_tenant("a", 32, seed=1)
        b, _b_weights, b_cache = make_tenant("b", 32, seed=2, cache_mib=32)
        await arbiter.register(0, LocalTenantHandle("a", a))
        await arbiter.register(0, LocalTenantHandle("b", b))
        digests = (_digest(a_weights),)
        rss = []
        for _ in range(rounds):
            await arbiter.wake("b")
            b_cache.fill_(2)  # the generator uses its cache while awake
            await arbiter.wake("a")
            rss.append(psutil.Process().memory_info().rss)
        return {"first": rss[0], "last": rss[-1], "a_identical": (_digest(a_weights),) == digests}

    return asyncio.run(run())


def test_two_hundred_alternations_do_not_drift(isolated):
    out = isolated(alternation_scenario, 200)
    assert out["a_identical"]
    assert abs(out["last"] - out["first"]) < 0.02 * out["first"], out


def concurrent_scenario(requests: int) -> dict:
    async def run():
        arbiter = SlotArbiter([0])
        made = {n: make_tenant(n, 8, seed=i) for i, n in enumerate("abc")}  # keeps tensors
        tenants = {n: m[0] for n, m in made.items()}
        for name, tenant in tenants.items():
            await arbiter.register(0, LocalTenantHandle(name, tenant))
        violations, samples = [], 0
        done = asyncio.Event()

        async def watch():
            nonlocal samples
            while not done.is_set():
                awake_by_arbiter = [n for n, s in arbiter.status()[0].items() if s]
                awake_by_memory = [n for n in tenants
                                   if memory.state(f"{n}/weights") is memory.TagState.ACTIVE]
                if len(awake_by_arbiter) > 1 or len(awake_by_memory) > 1:
                    violations.append((awake_by_arbiter, awake_by_memory))
                samples += 1
                await asyncio.sleep(0)

        async def client(seed: int):
            rng = random.Random(seed)
            for _ in range(requests):
                await arbiter.wake(rng.choice("abc"))

        watcher = asyncio.create_task(watch())
        await asyncio.gather(*(client(s) for s in range(4)))
        done.set()
        await watcher
        return {"violations": violations, "samples": samples, "final": arbiter.status()[0]}

    return asyncio.run(run())


def test_concurrent_conflicting_wakes_never_leave_two_awake(isolated):
    out = isolated(concurrent_scenario, 50)
    assert out["violations"] == []
    assert out["samples"] > 100
    assert sum(1 for stages in out["final"].values() if stages) == 1


def failing_sleep_scenario() -> dict:
    # A real fault: the host has no memory for backups and the backup directory is a file,
    # so the weights tenant cannot save itself.
    async def run():
        arbiter = SlotArbiter([0], ArbiterConfig(host_capacity_bytes=0,
                                                 backup_dir=sys.executable))
        trainer, weights, _ = make_tenant("trainer", 16, seed=1)
        # the generator needs no backup file, so it can sleep
        generator, generator_weights, _ = make_tenant("generator", 16, seed=2, backup=False)
        await arbiter.register(0, LocalTenantHandle("trainer", trainer))
        await arbiter.register(0, LocalTenantHandle("generator", generator))
        digest = _digest(weights)
        out = {}
        try:
            await arbiter.wake("generator")
        except SwitchError as err:
            out["error"] = str(err)
        out["status"] = arbiter.status()[0]
        out["trainer_intact"] = _digest(weights) == digest
        out["generator_state"] = memory.state("generator/weights").value
        return out

    return asyncio.run(run())


def test_a_tenant_whose_sleep_fails_leaves_a_consistent_reported_state(isolated):
    out = isolated(failing_sleep_scenario)
    assert "trainer failed to sleep" in out["error"]
    assert "trainer awake (weights)" in out["error"] and "generator was not woken" in out["error"]
    assert out["status"] == {"trainer": ["weights"], "generator": []}
    assert out["trainer_intact"]
    assert out["generator_state"] == "paused"


class LyingHandle(LocalTenantHandle):
    """A buggy tenant: says it sleeps, keeps its memory (a fault we inject on purpose)."""

    async def sleep(self, stages=None) -> int:
        return memory.resident_bytes("liar/weights")  # claims it, releases nothing


class FailingWakeHandle(LocalTenantHandle):
    """A tenant whose cache stage cannot come back (e.g. out of memory)."""

    async def wake(self, stages) -> None:
        await super().wake([s for s in stages if s != "kv_cache"])
        if "kv_cache" in stages:
            raise MemoryError("no room for the KV cache")


def faults_scenario() -> dict:
    async def run():
        out = {}
        arbiter = SlotArbiter([0], ArbiterConfig(release_timeout_s=0.2))
        liar, liar_weights, _ = make_tenant("liar", 64, seed=1)
        other, other_weights, _ = make_tenant("other", 8, seed=2)
        await arbiter.register(0, LocalTenantHandle("other", other))
        try:  # liar must sleep to join an awake slot, and does not
            await arbiter.register(0, LyingHandle("liar", liar))
        except ReleaseNotVerifiedError as err:
            out["register_error"] = str(err)
        out["after_register_error"] = arbiter.status()[0]

        arbiter = SlotArbiter([0], ArbiterConfig(release_timeout_s=0.2))
        await arbiter.register(0, LyingHandle("liar", liar))
        await arbiter.register(0, LocalTenantHandle("other", other))  # other sleeps fine
        try:
            await arbiter.wake("other")  # liar's sleep releases nothing
        except ReleaseNotVerifiedError as err:
            out["release_error"] = str(err)
        out["after_release_error"] = arbiter.status()[0]

        arbiter = SlotArbiter([0])
        gen, gen_weights, gen_cache = make_tenant("gen", 8, seed=3, cache_mib=8)
        trainer, trainer_weights, _ = make_tenant("trainer", 8, seed=4)
        digest = _digest(trainer_weights)
        await arbiter.register(0, LocalTenantHandle("trainer", trainer))
        await arbiter.register(0, FailingWakeHandle("gen", gen))
        try:
            await arbiter.wake("gen")
        except SwitchError as err:
            out["wake_error"] = str(err)
        out["after_wake_error"] = arbiter.status()[0]
        out["trainer_intact"] = _digest(trainer_weights) == digest
        await arbiter.wake("gen", stages=["weights"])  # a staged wake needs no cache
        out["staged"] = arbiter.status()[0]
        out["gen_cache_state"] = memory.state("gen/kv_cache").value
        try:
            await arbiter.wake("gen", stages=["optimizer"])
        except ArbiterError as err:
            out["stage_error"] = str(err)
        try:
            await arbiter.wake("nobody")
        except ArbiterError as err:
            out["unknown_error"] = str(err)
        return out

    return asyncio.run(run())


def test_faults_roll_back_and_say_who_is_awake(isolated):
    out = isolated(faults_scenario)
    assert "liar slept on slot 0 but only" in out["register_error"]
    assert "not registered" in out["register_error"]
    assert out["after_register_error"] == {"other": ["weights"]}
    assert "liar slept on slot 0 but only" in out["release_error"]
    assert "it was woken again" in out["release_error"]
    assert "other was not woken" in out["release_error"]
    assert out["after_release_error"] == {"liar": ["weights"], "other": []}
    assert "gen failed to wake ['weights', 'kv_cache']: no room" in out["wake_error"]
    assert out["after_wake_error"] == {"trainer": ["weights"], "gen": []}
    assert out["trainer_intact"]
    assert out["staged"] == {"trainer": [], "gen": ["weights"]}
    assert out["gen_cache_state"] == "paused"
    assert "no stage(s) ['optimizer']" in out["stage_error"]
    assert "'nobody' is not registered" in out["unknown_error"]


def budget_scenario() -> dict:
    async def run():
        made = {"small_a": make_tenant("small_a", 32, seed=1),
                "small_b": make_tenant("small_b", 32, seed=2),
                "big": make_tenant("big", 64, seed=3)}  # keeps the tensors alive
        for tenant, _, _ in made.values():
            tenant.sleep()
        config = ArbiterConfig(policy="budget", slot_capacity_bytes=110 * MiB)
        arbiter = SlotArbiter([0], config)
        for name, (tenant, _, _) in made.items():
            await arbiter.register(0, LocalTenantHandle(name, tenant))
        out = {"registered": arbiter.status()[0]}
        await arbiter.wake("small_a")
        await arbiter.wake("small_b")
        out["two_small"] = arbiter.status()[0]
        await arbiter.wake("big")  # needs the least recently woken small one to sleep
        out["big"] = arbiter.status()[0]
        return out

    return asyncio.run(run())


def test_budget_policy_keeps_several_awake_while_memory_allows(isolated):
    out = isolated(budget_scenario)
    assert out["registered"] == {"small_a": [], "small_b": [], "big": []}
    assert out["two_small"] == {"small_a": ["weights"], "small_b": ["weights"], "big": []}
    # 110 MiB: big (64) fits beside one small (32); the least recently woken one sleeps
    assert out["big"] == {"small_a": [], "small_b": ["weights"], "big": ["weights"]}


class AtMostTwoAwake:
    """A third policy, defined here and nowhere in colocate: two tenants may be awake on a
    slot; a third one's wake puts the least recently woken of them to sleep."""

    measures = False

    def may_share(self, awake) -> bool:
        return len(awake) <= 2

    def has_room(self, needed_bytes, free_bytes) -> bool:
        return True

    def to_sleep(self, waking, resident, needed_bytes, free_bytes):
        others = list(dict.fromkeys(r.tenant for r in resident if r.tenant != waking))
        return [r for r in resident if r.tenant == others[0]] if len(others) >= 2 else []


def third_policy_scenario() -> dict:
    async def run():
        made = {n: make_tenant(n, 16, seed=i) for i, n in enumerate("abc")}  # keeps tensors
        arbiter = SlotArbiter([0], ArbiterConfig(policy=AtMostTwoAwake()))
        digests = {n: _digest(weights) for n, (_, weights, _) in made.items()}
        out = {"registered": []}
        for name, (tenant, _, _) in made.items():
            await arbiter.register(0, LocalTenantHandle(name, tenant))
            out["registered"].append(arbiter.status()[0])
        await arbiter.wake("c")  # a, the least recently woken of the two awake, sleeps
        out["c"] = arbiter.status()[0]
        out["a_resident"] = memory.resident_bytes("a/weights")
        await arbiter.wake("a")  # b sleeps
        out["a"] = arbiter.status()[0]
        await arbiter.wake("c")  # already awake: nothing changes
        out["again"] = arbiter.status()[0]
        out["awake_intact"] = [_digest(made[n][1]) == digests[n] for n in "ac"]
        return out

    return asyncio.run(run())


def test_a_policy_defined_outside_colocate_runs_through_the_arbiter(isolated):
    out = isolated(third_policy_scenario)
    assert out["registered"] == [{"a": ["weights"]},
                                 {"a": ["weights"], "b": ["weights"]},  # b may stay awake
                                 {"a": ["weights"], "b": ["weights"], "c": []}]
    assert out["c"] == {"a": [], "b": ["weights"], "c": ["weights"]}
    assert out["a_resident"] == 0  # its sleep was real, and verified
    assert out["a"] == {"a": ["weights"], "b": [], "c": ["weights"]}
    assert out["again"] == out["a"]
    assert out["awake_intact"] == [True, True]  # a slept and woke with its contents


def test_a_new_policy_is_chosen_by_name_from_the_policies_table(monkeypatch):
    monkeypatch.setitem(POLICIES, "two", type("Two", (AtMostTwoAwake,), {
        "from_config": classmethod(lambda cls, config: cls())}))
    assert type(ArbiterConfig(policy="two").make_policy()).__name__ == "Two"
    assert isinstance(SlotArbiter([0], ArbiterConfig(policy="two")).policy, AtMostTwoAwake)


def lost_contents_scenario() -> dict:
    tenant, _, _ = make_tenant("lossy", 1, seed=0, cache_mib=1)
    tenant.sleep()
    tenant.wake(["weights", "kv_cache"])
    out = {"after_sleep": (tenant.lost("weights"), tenant.lost("kv_cache"))}
    tenant.refilled("kv_cache")
    out["refilled"] = tenant.lost("kv_cache")
    tenant.sleep(["weights"])  # the cache stays awake: nothing of it is lost
    out["weights_only"] = tenant.lost("kv_cache")
    return out


def test_a_stage_without_backup_is_lost_at_a_sleep_until_refilled(isolated):
    out = isolated(lost_contents_scenario)
    assert out == {"after_sleep": (False, True), "refilled": False, "weights_only": False}


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="policy"):
        ArbiterConfig(policy="fifo")
    with pytest.raises(ValueError, match="policy"):
        ArbiterConfig(policy=object())  # answers none of the policy's questions
    with pytest.raises(ValueError, match="release_fraction"):
        ArbiterConfig(release_fraction=0)
    with pytest.raises(ValueError, match="call_timeout_s"):
        ArbiterConfig(call_timeout_s=0)


class SlowWakeHandle(LocalTenantHandle):
    """A tenant whose wake takes a while (a large load from disk, say)."""

    async def wake(self, stages) -> None:
        await asyncio.sleep(0.5)
        await super().wake(stages)


def timeout_scenario() -> dict:
    async def run():
        arbiter = SlotArbiter([0], ArbiterConfig(request_timeout_s=0.1))
        slow, slow_weights, _ = make_tenant("slow", 4, seed=1)
        other, other_weights, _ = make_tenant("other", 4, seed=2)
        await arbiter.register(0, LocalTenantHandle("other", other))
        await arbiter.register(0, SlowWakeHandle("slow", slow))
        first = asyncio.create_task(arbiter.wake("slow"))  # holds slot 0 for 0.5 s
        await asyncio.sleep(0.01)
        out = {}
        try:
            await arbiter.wake("other")
        except ArbiterError as err:
            out["error"], out["kind"] = str(err), type(err).__name__
        await first
        out["status"] = arbiter.status()[0]
        await arbiter.wake("other")  # the slot is free again
        out["after"] = arbiter.status()[0]
        return out

    return asyncio.run(run())


def test_a_request_that_waits_too_long_for_its_slot_times_out(isolated):
    out = isolated(timeout_scenario)
    assert out["kind"] == "ArbiterTimeoutError"
    assert "waited 0.1 s for slot(s) [0]" in out["error"]
    assert out["status"] == {"other": [], "slow": ["weights"]}
    assert out["after"] == {"other": ["weights"], "slow": []}


def tenant_messages_scenario() -> dict:
    tenant = TaggedTenant({"policy": "actor/policy", "scratch": "actor/scratch"},
                          backup={"policy": True, "scratch": False})
    out = {}
    try:
        tenant.region("weights")
    except KeyError as err:
        out["unknown"] = (type(err).__name__, str(err))
    with tenant.region("policy", device="cpu"):
        weights = torch.ones(MiB // 4)
    tenant.sleep()
    for check in (tenant.ensure_awake, lambda: tenant.ensure_stage("policy")):
        try:
            check()
        except memory.TagPausedError as err:
            out.setdefault("asleep", []).append(str(err))
    del weights
    return out


def test_tenant_errors_name_the_stage_and_how_to_wake_it(isolated):
    out = isolated(tenant_messages_scenario)
    assert out["unknown"] == ("UnknownStageError",
                              "unknown stage 'weights'; stages: ['policy', 'scratch']")
    assert len(out["asleep"]) == 2
    for message in out["asleep"]:  # the arbiter's way, not the tag's low-level resume()
        assert message.startswith("tenant 'actor' is asleep (its stage 'policy' is paused)")
        assert "phase('actor')" in message and "rm.wake('actor')" in message
        assert "resume(" not in message
