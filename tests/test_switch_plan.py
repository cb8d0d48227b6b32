"""A switch is one message per proc: the arbiter's plan, carried out where the tenants are.

The tenants here are real (`TaggedTenant`s over memory tags of one process, which stands
for a slot's proc) and are reached as a proc's tenant actors are: each handle has
`run_plan`, which runs the plan with `plan.run_here` against the tenants of "its process"
(a dict, as the tenant actors of one Monarch proc), and counts every message. Each
scenario runs in a fresh process: its RSS is the slot's measured memory.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import torch

from colocate import memory
from colocate.arbiter import ArbiterConfig, SlotArbiter, SwitchError, TaggedTenant
from colocate.arbiter.plan import Plan, PlanResult, run_here
from colocate.arbiter.plan import clock as plan_clock

MiB = 1 << 20


class Tenant(TaggedTenant):
    """Weights (kept across a sleep) and a cache; `receive` copies another tenant's weights;
    `fail_at` makes one call raise (a fault in the middle of a plan)."""

    def __init__(self, name: str, mib: int, seed: int, here: dict[str, Tenant]) -> None:
        super().__init__({"weights": f"{name}/weights", "kv_cache": f"{name}/kv_cache"},
                         backup={"weights": True, "kv_cache": False}, name=name)
        with self.region("weights", device="cpu"):
            self.weights = torch.randint(0, 2**31, (mib * MiB // 4,), dtype=torch.int32,
                                         generator=torch.Generator().manual_seed(seed))
        with self.region("kv_cache", device="cpu"):
            self.cache = torch.ones(mib * MiB // 4)
        self.here = here
        self.fail_at: str | None = None  # "wake:kv_cache", "receive"
        here[name] = self

    def wake(self, stages: Any) -> None:
        for stage in stages:
            if self.fail_at == f"wake:{stage}":
                self.fail_at = None
                raise MemoryError(f"no room for {self.tenant}'s {stage}")
            super().wake([stage])

    def receive(self, source: str) -> int:
        if self.fail_at == "receive":
            self.fail_at = None
            raise RuntimeError("the copy broke off")
        self.weights.copy_(self.here[source].weights)
        return self.weights.numel() * 4


class ProcHandle:
    """A tenant of a proc, reached by messages that are counted: `run_plan` (a switch),
    and the single calls a plan replaces (`sleep`, `wake`, `receive`)."""

    def __init__(self, name: str, here: dict[str, Tenant], sent: Counter) -> None:
        self.name, self.here, self.sent = name, here, sent

    async def describe(self):
        self.sent["describe"] += 1
        return self.here[self.name].describe()

    async def run_plan(self, plan: Plan) -> PlanResult:
        self.sent["run_plan"] += 1
        self.sent["steps"] += len(plan.steps)
        return await asyncio.to_thread(run_here, plan, self.here.__getitem__)

    async def sleep(self, stages=None) -> int:
        self.sent["sleep"] += 1
        return self.here[self.name].sleep(stages)

    async def wake(self, stages) -> None:
        self.sent["wake"] += 1
        self.here[self.name].wake(stages)

    async def receive(self, source: str) -> int:
        self.sent["receive"] += 1
        return self.here[self.name].receive(source)


def states(*tenants: str) -> dict[str, list[str]]:
    """Each tenant's tag states, as the process holds them."""
    return {t: [memory.state(f"{t}/{s}").value for s in ("weights", "kv_cache")]
            for t in tenants}


def one_message_scenario() -> dict:
    async def run():
        here: dict[str, Tenant] = {}
        made = [Tenant(n, 8, seed, here) for seed, n in enumerate(("trainer", "gen", "ref"))]
        sent: Counter = Counter()
        arbiter = SlotArbiter([0])
        for tenant in made:
            await arbiter.register(0, ProcHandle(tenant.tenant, here, sent))
        out: dict[str, Any] = {"registered": arbiter.status()[0]}
        clocked = (plan_clock.plans, plan_clock.seconds)
        sends = []
        for target in ("gen", "ref", "trainer", "gen"):
            sent.clear()
            await arbiter.wake(target)
            sends.append(dict(sent))
        out["wakes"] = sends
        gen_weights = here["gen"].weights.clone()  # gen is awake: its weights are readable
        sent.clear()
        copied = await arbiter.handoff("gen", "trainer")
        out["handoff"] = (dict(sent), copied, arbiter.status()[0])
        out["same_weights"] = bool(torch.equal(here["trainer"].weights, gen_weights))
        out["states"] = states("trainer", "gen", "ref")
        out["clocked"] = (plan_clock.plans - clocked[0], plan_clock.seconds - clocked[1])
        return out

    return asyncio.run(run())


def test_a_switch_is_one_message_to_the_proc(isolated):
    out = isolated(one_message_scenario)
    assert out["registered"] == {"trainer": ["weights", "kv_cache"], "gen": [], "ref": []}
    # each wake: the other tenant's verified sleep and the target's wake, in one message
    assert out["wakes"] == [{"run_plan": 1, "steps": 2}] * 4
    sent, copied, status = out["handoff"]
    # sleep gen's cache, wake trainer's weights, receive, sleep gen, wake trainer's cache
    assert sent == {"run_plan": 1, "steps": 5}
    assert copied == 8 * MiB
    assert status == {"trainer": ["weights", "kv_cache"], "gen": [], "ref": []}
    assert out["same_weights"]
    assert out["states"] == {"trainer": ["active", "active"], "gen": ["paused", "paused"],
                             "ref": ["paused", "paused"]}
    plans, seconds = out["clocked"]  # the proc's own clock of its plans (bench/rl_step.py)
    assert plans == 5 and seconds > 0


def fault_in_plan_scenario() -> dict:
    async def run():
        here: dict[str, Tenant] = {}
        trainer, gen = Tenant("trainer", 8, 1, here), Tenant("gen", 8, 2, here)
        trainer_weights = trainer.weights.clone()
        gen_weights = gen.weights.clone()
        sent: Counter = Counter()
        arbiter = SlotArbiter([0], ArbiterConfig(release_timeout_s=1.0))
        for tenant in (trainer, gen):
            await arbiter.register(0, ProcHandle(tenant.tenant, here, sent))
        out: dict[str, Any] = {}
        # the plan's second step fails half-way: gen's weights are awake, its cache is not
        gen.fail_at = "wake:kv_cache"
        sent.clear()
        try:
            await arbiter.wake("gen")
        except SwitchError as err:
            out["wake_error"] = (type(err).__name__, str(err))
        out["wake_sent"] = dict(sent)
        out["after_wake"] = (arbiter.status()[0], states("trainer", "gen"))
        out["trainer_kept"] = bool(torch.equal(trainer.weights, trainer_weights))
        # a handoff that stops at its copy, after gen woke its weights and trainer slept
        # its cache
        gen.fail_at = "receive"
        sent.clear()
        try:
            await arbiter.handoff("trainer", "gen")
        except SwitchError as err:
            out["handoff_error"] = (type(err).__name__, str(err))
        out["handoff_sent"] = dict(sent)
        out["after_handoff"] = (arbiter.status()[0], states("trainer", "gen"))
        await arbiter.wake("gen")  # its weights are readable awake
        out["gen_kept"] = bool(torch.equal(gen.weights, gen_weights))
        await arbiter.wake("trainer")
        await arbiter.handoff("trainer", "gen")  # the next one goes through
        out["after_retry"] = arbiter.status()[0]
        return out

    return asyncio.run(run())


def test_a_fault_in_the_middle_of_a_plan_rolls_back_and_says_where(isolated):
    out = isolated(fault_in_plan_scenario)
    kind, message = out["wake_error"]
    assert kind == "SwitchError"
    assert message.startswith("gen failed to wake ['weights', 'kv_cache']: no room for gen's "
                              "kv_cache; rolled back: slot 0: trainer awake (weights, "
                              "kv_cache), gen asleep"), message
    assert out["wake_sent"] == {"run_plan": 2, "steps": 4}  # the plan, then its rollback
    # nobody half awake: gen's weights, woken by the plan, were put back to sleep
    assert out["after_wake"] == ({"trainer": ["weights", "kv_cache"], "gen": []},
                                 {"trainer": ["active", "active"], "gen": ["paused", "paused"]})
    assert out["trainer_kept"]
    kind, message = out["handoff_error"]
    assert kind == "SwitchError"
    assert message.startswith("handoff trainer -> gen failed on slot 0 at gen.receive(trainer): "
                              "the copy broke off; rolled back: slot 0: trainer awake "
                              "(weights, kv_cache), gen asleep"), message
    assert "gen's ['weights'] may hold part of trainer's now" in message
    assert out["handoff_sent"] == {"run_plan": 2, "steps": 5 + 2}  # the whole plan, 2 restores
    assert out["after_handoff"] == ({"trainer": ["weights", "kv_cache"], "gen": []},
                                    {"trainer": ["active", "active"],
                                     "gen": ["paused", "paused"]})
    assert out["gen_kept"]  # the copy broke off before writing
    assert out["after_retry"] == {"trainer": [], "gen": ["weights", "kv_cache"]}


def test_a_plan_calls_a_tenant_only_once_its_running_call_is_done():
    """In a proc, the plan runs on one tenant actor's thread and calls into the others:
    each of their endpoints holds the tenant's busy lock, so a plan's sleep waits for the
    call the tenant is running, and no call of it runs during the sleep."""
    import threading
    import time

    from monarch.actor import endpoint

    from colocate.arbiter.actor import TenantActor, _OwnCalls

    events: list[str] = []

    class Busy(TenantActor):
        @endpoint
        def work(self, seconds: float) -> None:
            events.append("work starts")
            time.sleep(seconds)
            events.append("work ends")

        @endpoint
        def sleep(self, stages=None) -> int:
            events.append("sleep")
            return 0

    actor = Busy.__new__(Busy)  # its methods, as Monarch calls them (no proc needed)
    working = threading.Thread(target=Busy.work._method, args=(actor, 0.3))
    working.start()
    while not events:
        time.sleep(0.001)
    _OwnCalls(actor).sleep(None)  # what run_here calls for a step of this tenant
    working.join()
    assert events == ["work starts", "work ends", "sleep"]
