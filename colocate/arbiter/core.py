"""The arbiter's decisions for the slots of one host, free of Monarch so it runs anywhere.

For each slot (a GPU, or a CPU proc standing in for one) it knows the tenants and which
stages of each are awake. A request (`wake`, `sleep`, `register`, `handoff`, `make_room`)
becomes plans per slot: the policy's sleeps, each verified by measurement, then the wakes
(under the budget policy, a round of sleeps at a time, `room.py`). A plan goes to the
slot's proc in one message and is carried out there against the tenants of that process
(delivery.py, plan.py); the answer says what happened or where it stopped. Requests hold
their slots' locks, taken in slot order, so they are served in arrival order per slot. A
failure rolls the slot back to where the request found it (undo.py), and the error says
where it stopped and who is awake where. A tenant whose proc died is lost at once.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TypeVar

from colocate.arbiter import room
from colocate.arbiter.config import ArbiterConfig, ArbiterConfigError
from colocate.arbiter.delivery import AFTER_LOSS, Courier, find_lost, watched
from colocate.arbiter.errors import ArbiterError, SwitchError, TenantLostError
from colocate.arbiter.explain import Explain, PlanFailed, raise_errors, step_error, switch_error
from colocate.arbiter.handoff_plan import handoff_error, handoff_steps
from colocate.arbiter.host_budget import HostLedger, host_capacity
from colocate.arbiter.plan import RECEIVE, SLEEP, WAKE, PlanResult, Step
from colocate.arbiter.slot import Slot, SlotTraffic, holding
from colocate.arbiter.tenant import TenantHandle, TenantInfo
from colocate.arbiter.undo import UndoLog

__all__ = ["ArbiterConfig", "ArbiterConfigError", "PlanFailed", "Slot", "SlotArbiter"]

T = TypeVar("T")


class SlotArbiter:
    """Time-shares the memory of one host's slots between their tenants."""

    def __init__(self, slots: Sequence[int], config: ArbiterConfig | None = None) -> None:
        self.config = config or ArbiterConfig()
        self.policy = self.config.make_policy()
        self.slots = {i: Slot(i) for i in slots}
        self.courier = Courier(self.config)
        capacity = self.config.host_capacity_bytes
        self.host = HostLedger(host_capacity() if capacity is None else capacity,
                               self.config.backup_dir)

    # -- plumbing -------------------------------------------------------------------

    def _slot(self, index: int) -> Slot:
        if index not in self.slots:
            raise ArbiterError(f"slot {index} is not on this host (slots: {sorted(self.slots)})")
        return self.slots[index]

    def _slots_of(self, name: str, slots: Iterable[int] | None) -> list[Slot]:
        chosen = [self._slot(i) for i in sorted(set(slots))] if slots is not None else \
            [s for s in self.slots.values() if name in s.tenants]
        missing = [s.index for s in chosen if name not in s.tenants]
        if missing or not chosen:
            raise ArbiterError(f"tenant {name!r} is not registered on slot(s) "
                               f"{missing or 'any'}; registered: {self.tenants()}")
        return chosen

    def _hold(self, slots: list[Slot]) -> AbstractAsyncContextManager[None]:
        return holding(slots, self.config.request_timeout_s)

    async def _call(self, what: str, call: Awaitable[T], slot: Slot | None = None,
                    name: str | None = None) -> T:
        return await watched(self.config.call_timeout_s, what, call, slot, name)

    def _free(self, slot: Slot) -> int | None:
        """The slot's free memory where the policy needs it, else None (nothing measured)."""
        return room.free_bytes(slot, self.config) if self.policy.measures else None

    def _check(self, slot: Slot) -> None:
        awake = slot.awake_tenants()
        if not self.policy.may_share(awake):
            raise ArbiterError(f"invariant broken, {awake} awake together against the "
                               f"policy: {slot.who()}")

    def _may_stay(self, slot: Slot) -> bool:
        """Whether the tenants awake on `slot` may stay so, as the policy sees it."""
        return self.policy.may_share(slot.awake_tenants()) \
            and self.policy.has_room(0, self._free(slot))

    # -- plans ------------------------------------------------------------------------

    def _sleep_step(self, slot: Slot, name: str,
                    stages: Sequence[str] | None = None) -> Step | None:
        """A verified sleep of `name`'s awake `stages` (default: all); None if none is."""
        awake = slot.awake.get(name, ())
        if not any(stages is None or s in stages for s in awake):
            return None
        todo = None if stages is None else tuple(s for s in awake if s in stages)
        return Step(SLEEP, name, todo, verify=True, device=slot.infos[name].device)

    async def _attempt(self, slot: Slot, log: UndoLog, steps: list[Step | None]
                       ) -> PlanResult:
        """Carry out `steps` on `slot` (one message per proc); on success record their
        effect, else raise `PlanFailed` (the caller rolls back)."""
        plan = [step for step in steps if step is not None]
        log.remember(slot, (step.tenant for step in plan))
        if not plan:
            return PlanResult()
        if self.host.unsure(slot, plan):
            await self._describe_all(slot)
        plan = self.host.place(slot, plan)  # where each kept stage's backup goes
        result = await self.courier.carry_out(slot, plan, log)
        self.host.observe(result.backups)
        self.host.settle(slot, plan[:result.done])
        slept = dict(slot.traffic.slept)
        for step in plan[:result.done]:
            if step.op == SLEEP:
                for stage in slot.awake.get(step.tenant, ()):
                    if step.stages is None or stage in step.stages:
                        slept[step.tenant, stage] = slept.get((step.tenant, stage), 0) + 1
        before = slot.traffic
        moved = before.moved + result.moved
        slot.traffic = SlotTraffic(moved, slept, before.peak_bytes, max(
            before.backup_peak_bytes, moved.copied_out - before.moved.copied_in))
        if result.failure is not None:
            raise PlanFailed(result.failure, plan[result.failure.index])
        for step in plan:
            awake = slot.awake.get(step.tenant, ())
            if step.op == SLEEP:
                slot.mark(step.tenant, () if step.stages is None
                          else [s for s in awake if s not in step.stages])
                slot.unknown.discard(step.tenant)
            elif step.op == WAKE:
                slot.mark(step.tenant, [*awake, *(s for s in step.stages or ()
                                                  if s not in awake)])
        return result

    async def _request(self, slot: Slot, body: Callable[[UndoLog], Awaitable[T]],
                       explain: Explain) -> T:
        """Run `body` under one undo log; on any failure roll `slot` back, then raise (a
        failed step: the error `explain` makes of it)."""
        log = UndoLog()
        try:
            return await body(log)
        except PlanFailed as failed:
            note = await self._roll_back(slot, log)
            raise explain(failed, note) from failed.failure.error
        except BaseException:
            await self._roll_back(slot, log)
            raise

    async def _roll_back(self, slot: Slot, log: UndoLog) -> str:
        """Bring `slot`'s tenants back to the log's before-state; record what each says it
        holds. Returns "" or, when the rollback itself stopped, a note saying where."""
        steps = log.restore_steps(slot)
        if not steps:
            return ""
        result = await self.courier.carry_out(slot, steps, log)
        for name, info in result.infos.items():
            slot.learned(name, info)
        said = set(result.infos)
        for step in steps:
            if step.tenant not in said and step.tenant not in slot.lost:
                slot.unknown.add(step.tenant)
                slot.mark(step.tenant, ("?",))
        self.host.observe(result.backups)
        self.host.resync(slot)
        failure = result.failure
        return "" if failure is None else f"; the rollback stopped at {failure.label}: " \
                                          f"{failure.cause}"

    # -- the requests -------------------------------------------------------------------

    async def register(self, index: int, handle: TenantHandle) -> TenantInfo:
        """Add a tenant on a slot. If the policy does not allow it awake there, it sleeps;
        if it cannot, it is not registered."""
        slot = self._slot(index)
        name = handle.name
        if name in slot.tenants:
            raise ArbiterError(f"tenant {name!r} is already registered on slot {index}")
        async with self._hold([slot]):
            info = await self._call(f"{name}.describe", handle.describe())
            others = slot.awake_tenants()
            slot.tenants[name], slot.infos[name] = handle, info
            slot.mark(name, info.awake_stages)
            try:
                if info.awake_stages and others and not self._may_stay(slot):
                    await self._request(slot, lambda log: self._attempt(
                        slot, log, [self._sleep_step(slot, name)]),
                        switch_error(slot, None))
                self._check(slot)
            except BaseException as err:
                slot.forget(name)
                raise type(err)(f"{err}; {name} was not registered") from err
            return info

    async def unregister(self, name: str, slots: Iterable[int] | None = None) -> None:
        """Forget `name` on its slots (its actors are being stopped)."""
        chosen = self._slots_of(name, slots)
        async with self._hold(chosen):
            for slot in chosen:
                slot.forget(name)
                self.host.forget(slot.index, name)

    async def wake(self, name: str, slots: Iterable[int] | None = None,
                   stages: Sequence[str] | None = None) -> None:
        """Make `name` awake on its slots (all, or `slots`), with `stages` (default: all)."""
        chosen = self._slots_of(name, slots)
        async with self._hold(chosen):
            results = await asyncio.gather(
                *(self._wake_on(slot, name, stages) for slot in chosen), return_exceptions=True)
        raise_errors(results, chosen)

    async def make_room(self, name: str, asked_bytes: int,
                        slots: Iterable[int] | None = None) -> None:
        """A call of `name` asked `asked_bytes` of working memory, more than its slot had
        free: learn that its calls need that much (beyond its declared working memory) for
        every later wake of it, and make the room now, by the policy's sleeps (raises
        `SwitchError`, naming the bytes, when they cannot make it)."""
        chosen = self._slots_of(name, slots)
        async with self._hold(chosen):
            for slot in chosen:
                beyond = asked_bytes - slot.infos[name].working_bytes
                slot.extra_need[name] = max(slot.extra_need.get(name, 0), beyond)
                slot.holder = None
            results = await asyncio.gather(*(self._wake_on(slot, name, None)
                                             for slot in chosen), return_exceptions=True)
        raise_errors(results, chosen)

    async def sleep(self, name: str, slots: Iterable[int] | None = None) -> None:
        """Put `name` to sleep on its slots (all, or `slots`), verified by measurement."""
        chosen = self._slots_of(name, slots)
        async with self._hold(chosen):
            results = await asyncio.gather(*(self._request(
                slot, lambda log, s=slot: self._attempt(s, log, [self._sleep_step(s, name)]),
                switch_error(slot, None)) for slot in chosen), return_exceptions=True)
        raise_errors(results, chosen)

    async def _wake_on(self, slot: Slot, name: str, stages: Sequence[str] | None) -> None:
        if name in slot.lost:
            raise TenantLostError(f"{name} cannot wake on slot {slot.index}: it is lost "
                                  f"({slot.lost[name]}). " + AFTER_LOSS.format(slot=slot.index),
                                  slot.index, tuple(slot.lost))
        known = slot.infos[name].stages  # fixed at registration
        unknown = [s for s in stages or () if s not in known]
        if unknown:
            raise ArbiterError(f"{name} has no stage(s) {unknown}; its stages: {known}")
        wanted = tuple(stages or known)
        todo = tuple(s for s in wanted if s not in slot.awake.get(name, ()))
        if not todo and (not self.policy.measures or slot.holder == name):
            return
        wake = [Step(WAKE, name, todo, device=slot.infos[name].device)] if todo else []

        async def exclusive(log: UndoLog) -> None:  # sleeps known ahead: one plan
            chosen = self.policy.to_sleep(name, room.residents(slot, name, wanted), 0, None)
            strays = [r for r in chosen if r.tenant == name or not slot.awake.get(r.tenant)]
            if strays:
                raise ArbiterError(f"the policy chose {strays[0].tenant!r} to sleep so that "
                                   f"{name} can wake, but it is not another awake tenant: "
                                   f"{slot.who()}")
            await self._attempt(slot, log, [*room.sleep_steps(slot, chosen), *wake])

        async def measured(log: UndoLog) -> None:  # each sleep changes the free memory
            await self._make_room(slot, log, name, wanted, todo, then=wake)
            self._note_peak(slot, name)

        await self._request(slot, measured if self.policy.measures else exclusive,
                            switch_error(slot, name))
        self._check(slot)

    async def _describe_all(self, slot: Slot) -> None:
        """Ask every live tenant of `slot` for its account (sizes grow as tenants work)."""
        live = [n for n in slot.tenants if n not in slot.lost]
        infos = await asyncio.gather(*(self._call(f"{n}.describe", slot.tenants[n].describe(),
                                                  slot, n) for n in live))
        slot.infos.update(zip(live, infos, strict=True))

    async def _make_room(self, slot: Slot, log: UndoLog, name: str, wanted: Sequence[str],
                         todo: Sequence[str], protect: Sequence[tuple[str, str]] = (),
                         working: bool = True, then: Sequence[Step] = ()) -> PlanResult:
        """Sleep what the policy chooses until waking `todo` of `name` fits, then carry
        out `then` (its answer is returned; with `working`, once it went through, `name`
        holds the slot for its calls, with its working memory). Each round of sleeps is
        verified and the free memory measured again (on a CPU slot, whose count is exact,
        the last round and `then` go as one plan). Raises `SwitchError` when nothing more
        may sleep and it still does not fit. The tenants' sizes are asked first, unless
        those known fit with every tenant's declared working memory to spare."""
        if not self.policy.has_room(
                room.needed_bytes(slot, name, todo, working) + room.growth_bound(slot),
                self._free(slot)):
            await self._describe_all(slot)
        needed = room.needed_bytes(slot, name, todo, working)
        for _ in range(len(room.residents(slot, name, wanted, protect)) + 1):
            free = self._free(slot)
            if self.policy.has_room(needed, free):
                return await self._take(slot, log, name, working, list(then))
            chosen = self.policy.to_sleep(name, room.residents(slot, name, wanted, protect),
                                          needed, free)
            if not chosen:
                break
            sleeps = room.sleep_steps(slot, chosen)
            if slot.infos[name].device == "cpu" and self.policy.has_room(
                    needed, free + sum(r.nbytes for r in chosen)):
                return await self._take(slot, log, name, working, [*sleeps, *then])
            await self._attempt(slot, log, sleeps)
        raise SwitchError(f"{name} cannot wake on slot {slot.index}: it needs {needed} bytes "
                          f"(its stages {list(todo)} and working memory) but only "
                          f"{self._free(slot)} are free after the policy's sleeps: "
                          f"{slot.who()}")

    async def _take(self, slot: Slot, log: UndoLog, name: str, working: bool,
                    plan: list[Step]) -> PlanResult:
        result = await self._attempt(slot, log, plan)
        slot.holder = name if working else slot.holder
        return result

    def _note_peak(self, slot: Slot, holder: str) -> None:  # after a switch to `holder`
        t = slot.traffic
        slot.traffic = SlotTraffic(t.moved, t.slept,
                                   max(t.peak_bytes, room.used_bytes(slot, holder)),
                                   t.backup_peak_bytes)

    # -- handoff: the one moment two tenants are partly awake ----------------------------

    async def handoff(self, source: str, target: str, slots: Iterable[int] | None = None,
                      keep: Sequence[str] = ("weights",), first: Sequence[str] = ("weights",)
                      ) -> int:
        """Pass weights from `source` to `target` on their shared slots, staged (see
        `handoff.handoff_steps`); returns the bytes copied. On failure the slot goes back
        to `source` awake (as it was) and `target` asleep."""
        chosen = self._slots_of(target, slots)
        self._slots_of(source, [s.index for s in chosen])
        async with self._hold(chosen):
            results = await asyncio.gather(
                *(self._handoff_on(slot, source, target, keep, first) for slot in chosen),
                return_exceptions=True)
        raise_errors(results, chosen)
        return sum(results)

    async def _handoff_on(self, slot: Slot, source: str, target: str, keep: Sequence[str],
                          first: Sequence[str]) -> int:
        steps = handoff_steps(slot, source, target, keep, first)

        async def exclusive(log: UndoLog) -> PlanResult:
            return await self._attempt(slot, log, list(steps))

        async def measured(log: UndoLog) -> PlanResult:
            """Only what the slot lacks moves: the target's first stages wake beside the
            source's kept ones, it copies, then room is made for its other stages and its
            working memory, the source's stages cheapest first (the source stays when it
            fits)."""
            stages, device = slot.infos[target].stages, slot.infos[target].device
            asleep = [s for s in first if s not in slot.awake.get(target, ())]
            wake = [Step(WAKE, target, tuple(asleep), device=device)] if asleep else []
            result = await self._make_room(
                slot, log, target, first, asleep, protect=[(source, s) for s in keep],
                working=False, then=[*wake, Step(RECEIVE, target, source=source, device=device)])
            rest = [s for s in stages if s not in slot.awake.get(target, ())]
            await self._make_room(slot, log, target, stages, rest,
                                  then=[Step(WAKE, target, tuple(rest), device=device)] if rest
                                  else [])
            self._note_peak(slot, target)
            return result

        def explain(failed: PlanFailed, note: str) -> SwitchError:
            text = handoff_error(slot, source, target, first, failed.failure, failed.step,
                                 note)
            return step_error(slot, failed, text, [source, target])

        result = await self._request(
            slot, measured if self.policy.measures else exclusive, explain)
        self._check(slot)
        return result.copied

    # -- queries -----------------------------------------------------------------------

    def tenants(self) -> dict[str, list[int]]:
        found: dict[str, list[int]] = {}
        for slot in self.slots.values():
            for name in slot.tenants:
                found.setdefault(name, []).append(slot.index)
        return found

    def find_lost(self, names: Iterable[str]) -> dict[str, str]:
        """Check now that the procs of `names` run (`delivery.find_lost`)."""
        return find_lost(self.slots.values(), names)

    def host_memory(self) -> dict[str, int | str | None]:
        """The host's backups: capacity, peaks, held now (`HostLedger.summary`)."""
        return self.host.summary()

    def traffic(self) -> dict[int, SlotTraffic]:
        """Per slot: what its switches moved so far (`SlotTraffic`)."""
        return {slot.index: slot.traffic for slot in self.slots.values()}

    def status(self) -> dict[int, dict[str, list[str] | None]]:
        """Per slot: tenant -> its awake stages ([] asleep; None when unknown or lost)."""
        return {
            slot.index: {name: None if name in slot.unknown or name in slot.lost
                         else list(slot.awake.get(name, ()))
                         for name in slot.tenants}
            for slot in self.slots.values()
        }
