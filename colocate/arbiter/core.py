"""The arbiter's logic for the slots of one host, free of Monarch so it runs anywhere.

For each slot (a GPU, or a CPU proc standing in for one) it knows the tenants and which
stages of each are awake. `wake(tenant)` puts conflicting tenants to sleep, checks by
measurement that their memory came back (NVML on GPU, the proc's RSS on CPU), then wakes
the tenant stage by stage. Requests hold their slots' locks, taken in slot order, so they
are served in arrival order per slot. A failure rolls the slot back (the sleeper woken
again, or the half-woken tenant put back to sleep) and the error says who is awake where.
While it waits for a tenant, it watches the tenant's process: a tenant whose proc died is
lost at once (with the other tenants of that proc on the slot), not after a timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TypeVar

from colocate import telemetry
from colocate.arbiter.errors import (
    ArbiterError,
    ArbiterTimeoutError,
    ReleaseNotVerifiedError,
    SwitchError,
    TenantLostError,
)
from colocate.arbiter.policy import POLICIES, Policy
from colocate.arbiter.tenant import TenantHandle, TenantInfo
from colocate.checks import check_choice, check_int, check_number

T = TypeVar("T")
LIVENESS_POLL_S = 0.05  # how often a pending tenant call checks that the tenant's proc runs
_AFTER_LOSS = ("To use slot {slot} again, remove its lost tenants (rm.remove) and give it new "
               "procs (rm.release(group), then allocate again)")
class ArbiterConfigError(ArbiterError, ValueError):
    """An ArbiterConfig field of the wrong type or out of range, named in the message."""


@dataclass(frozen=True)
class ArbiterConfig:
    """How strict and how patient the arbiter is. Validated here, once: each field's type
    (numbers finite, byte counts ints), then its range."""

    policy: str | Policy = "exclusive"  # a name in POLICIES, or a policy object
    release_fraction: float = 0.9  # of a sleeper's resident bytes, measured back
    release_timeout_s: float = 10.0
    request_timeout_s: float = 300.0
    call_timeout_s: float = 120.0
    min_verified_bytes: int = 1 << 20  # smaller releases are below measurement noise
    slot_capacity_bytes: int | None = None  # CPU slots: the budget policy's capacity
    headroom_bytes: int = 0  # budget policy

    def __post_init__(self) -> None:
        policy = None if isinstance(self.policy, Policy) \
            else check_choice("policy", self.policy, POLICIES)
        for problem in (
                policy and f"{policy}, or an object that answers what "
                "colocate.arbiter.policy.Policy asks",
                check_number("release_fraction", self.release_fraction, above=0, at_most=1),
                *(check_number(name, getattr(self, name), above=0) for name in (
                    "release_timeout_s", "request_timeout_s", "call_timeout_s")),
                check_int("min_verified_bytes", self.min_verified_bytes, 0),
                check_int("slot_capacity_bytes", self.slot_capacity_bytes, 1, optional=True),
                check_int("headroom_bytes", self.headroom_bytes, 0)):
            if problem:
                raise ArbiterConfigError(f"ArbiterConfig.{problem}")

    def make_policy(self) -> Policy:
        if isinstance(self.policy, str):
            return POLICIES[self.policy].from_config(self)
        return self.policy


@dataclass
class Slot:
    """One slot's tenants and their awake stages."""

    index: int
    tenants: dict[str, TenantHandle] = field(default_factory=dict)
    infos: dict[str, TenantInfo] = field(default_factory=dict)
    awake: dict[str, tuple[str, ...]] = field(default_factory=dict)
    woken_order: list[str] = field(default_factory=list)  # least recently woken first
    unknown: set[str] = field(default_factory=set)  # state lost after a failure
    lost: dict[str, str] = field(default_factory=dict)  # tenant -> why: its proc died
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def awake_tenants(self) -> list[str]:
        return [name for name in self.woken_order if self.awake.get(name)]

    def mark(self, name: str, stages: Iterable[str]) -> None:
        stages = tuple(stages)
        self.awake[name] = stages
        if name in self.woken_order:
            self.woken_order.remove(name)
        self.woken_order.append(name)

    def who(self) -> str:
        parts = []
        for name in self.tenants:
            if name in self.lost:
                parts.append(f"{name} lost ({self.lost[name]})")
            elif name in self.unknown:
                parts.append(f"{name} unknown (treated as awake)")
            elif self.awake.get(name):
                parts.append(f"{name} awake ({', '.join(self.awake[name])})")
            else:
                parts.append(f"{name} asleep")
        return f"slot {self.index}: " + (", ".join(parts) or "no tenants")


class SlotArbiter:
    """Time-shares the memory of one host's slots between their tenants."""

    def __init__(self, slots: Sequence[int], config: ArbiterConfig | None = None) -> None:
        self.config = config or ArbiterConfig()
        self.policy = self.config.make_policy()
        self.slots = {i: Slot(i) for i in slots}

    # -- measurement ------------------------------------------------------------------

    def _reading(self, slot: Slot, name: str, during: str) -> telemetry.MemoryReading:
        """The memory of `name`'s process: its RSS (CPU), or its share of its GPU where NVML
        gives per-process usage (device-wide otherwise), so other processes on the GPU do
        not blur the release check. A process that died loses its tenants."""
        info = slot.infos[name]
        try:
            if info.device == "cpu":
                reading = telemetry.read_pid(info.pid)
            else:
                reading = telemetry.read_gpu_uuid_process(info.device, info.pid)
        except telemetry.TelemetryError:
            if not telemetry.process_runs(info.pid):
                raise self._lose(slot, info.pid, during) from None
            raise
        if not telemetry.process_runs(info.pid):  # a dying process reads as released: it is lost
            raise self._lose(slot, info.pid, during)
        return reading

    def _free(self, slot: Slot) -> int | None:
        """The slot's free memory where the policy needs it, else None (nothing measured)."""
        return self._free_bytes(slot) if self.policy.measures else None

    def _free_bytes(self, slot: Slot) -> int:
        # colocated tenants share the process; a lost tenant's process is gone
        info = next(i for n, i in slot.infos.items() if n not in slot.lost)
        reading = telemetry.read_pid(info.pid) if info.device == "cpu" \
            else telemetry.read_gpu_uuid(info.device)
        capacity = reading.total_bytes or self.config.slot_capacity_bytes
        if capacity is None:
            raise ArbiterError(f"slot {slot.index} has no known capacity: on CPU slots the "
                               "budget policy needs ArbiterConfig.slot_capacity_bytes")
        return capacity - reading.used_bytes

    async def _released(self, slot: Slot, name: str, before: int, expected: int) -> int:
        """Poll until `name`'s memory fell by the expected share; returns the drop seen."""
        deadline = time.monotonic() + self.config.release_timeout_s
        while True:
            drop = before - self._reading(slot, name, f"the release check of {name}'s "
                                          "sleep").used_bytes
            if drop >= self.config.release_fraction * expected or time.monotonic() > deadline:
                return drop
            await asyncio.sleep(0.002)

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

    @asynccontextmanager
    async def _hold(self, slots: list[Slot]) -> AsyncIterator[None]:
        held: list[Slot] = []
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                for slot in slots:  # in slot order: no deadlock between requests
                    await slot.lock.acquire()
                    held.append(slot)
        except TimeoutError:
            for slot in held:
                slot.lock.release()
            raise ArbiterTimeoutError(
                f"waited {self.config.request_timeout_s} s for slot(s) "
                f"{[s.index for s in slots]}; busy with earlier requests. "
                + "; ".join(s.who() for s in slots)
            ) from None
        try:
            yield
        finally:
            for slot in held:
                slot.lock.release()

    async def _call(self, what: str, call: Awaitable[T], slot: Slot | None = None,
                    name: str | None = None) -> T:
        """`call`'s answer within `call_timeout_s`. For a call to tenant `name` of `slot`,
        the tenant's proc is watched meanwhile: if it dies, its tenants are lost at once."""
        task = asyncio.ensure_future(call)
        pid = slot.infos[name].pid if slot is not None and name is not None else None
        deadline = time.monotonic() + self.config.call_timeout_s
        try:
            while not task.done():
                if pid is not None and not telemetry.process_runs(pid):
                    raise self._lose(slot, pid, what)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ArbiterTimeoutError(
                        f"{what} did not answer within {self.config.call_timeout_s} s")
                await asyncio.wait({task}, timeout=min(left, LIVENESS_POLL_S))
            return task.result()
        finally:
            if not task.done():
                task.cancel()

    def _lose(self, slot: Slot, pid: int, during: str) -> TenantLostError:
        """Mark every tenant of process `pid` on `slot` lost (asleep: a dead process holds
        nothing), and return the error that says so."""
        why = f"its proc, pid {pid}, died during {during}"
        names = [n for n, info in slot.infos.items() if info.pid == pid]
        for name in names:
            slot.lost.setdefault(name, why)
            slot.unknown.discard(name)
            slot.mark(name, ())
        return TenantLostError(f"{' and '.join(names)} lost on slot {slot.index}: {why}. "
                               + _AFTER_LOSS.format(slot=slot.index), slot.index,
                               tuple(slot.lost))

    @staticmethod
    def _failed(slot: Slot, names: Iterable[str], message: str) -> SwitchError:
        """The error for a failed step: a TenantLostError when it lost one of `names`."""
        if any(n in slot.lost for n in names):
            return TenantLostError(message, slot.index, tuple(slot.lost))
        return SwitchError(message)

    async def _learn(self, slot: Slot, name: str) -> None:
        """Ask a tenant for its real state after a failure; lost if its proc died, unknown
        if it cannot say."""
        if name in slot.lost:
            return
        pid = slot.infos[name].pid
        if not telemetry.process_runs(pid):
            self._lose(slot, pid, f"a call to {name}")
            return
        try:
            info = await self._call(f"{name}.describe", slot.tenants[name].describe(),
                                    slot, name)
        except TenantLostError:
            return
        except Exception:
            slot.unknown.add(name)
            slot.mark(name, ("?",))
            return
        slot.unknown.discard(name)
        slot.infos[name] = info
        slot.mark(name, info.awake_stages)

    def _check(self, slot: Slot) -> None:
        awake = slot.awake_tenants()
        if not self.policy.may_share(awake):
            raise ArbiterError(f"invariant broken, {awake} awake together against the "
                               f"policy: {slot.who()}")

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
                    await self._sleep_verified(slot, name)
                self._check(slot)
            except BaseException as err:
                self._forget(slot, name)
                raise type(err)(f"{err}; {name} was not registered") from err
            return info

    async def unregister(self, name: str, slots: Iterable[int] | None = None) -> None:
        """Forget `name` on its slots (its actors are being stopped)."""
        chosen = self._slots_of(name, slots)
        async with self._hold(chosen):
            for slot in chosen:
                self._forget(slot, name)

    def _forget(self, slot: Slot, name: str) -> None:
        for table in (slot.tenants, slot.infos, slot.awake, slot.lost):
            table.pop(name, None)
        slot.unknown.discard(name)
        if name in slot.woken_order:
            slot.woken_order.remove(name)

    def _may_stay(self, slot: Slot) -> bool:
        """Whether the tenants awake on `slot` may stay so, as the policy sees it."""
        return self.policy.may_share(slot.awake_tenants()) \
            and self.policy.has_room(0, self._free(slot))

    async def wake(self, name: str, slots: Iterable[int] | None = None,
                   stages: Sequence[str] | None = None) -> None:
        """Make `name` awake on its slots (all, or `slots`), with `stages` (default: all)."""
        chosen = self._slots_of(name, slots)
        async with self._hold(chosen):
            results = await asyncio.gather(
                *(self._wake_on(slot, name, stages) for slot in chosen), return_exceptions=True)
        self._raise_errors(results, chosen)

    async def sleep(self, name: str, slots: Iterable[int] | None = None) -> None:
        """Put `name` to sleep on its slots (all, or `slots`), verified by measurement."""
        chosen = self._slots_of(name, slots)
        async with self._hold(chosen):
            results = await asyncio.gather(
                *(self._sleep_verified(slot, name) for slot in chosen), return_exceptions=True)
        self._raise_errors(results, chosen)

    def _raise_errors(self, results: list, slots: list[Slot]) -> None:
        errors = [r for r in results if isinstance(r, BaseException)]
        if len(errors) == 1:
            raise errors[0]
        if not errors:
            return
        message = f"{len(errors)} of {len(slots)} slots failed: " + " | ".join(map(str, errors))
        lost = [e for e in errors if isinstance(e, TenantLostError)]
        if lost:  # every lost tenant is named, so the caller can mark them all failed
            raise TenantLostError(message, lost[0].slot, tuple(
                dict.fromkeys(name for e in lost for name in e.tenants))) from errors[0]
        raise SwitchError(message) from errors[0]

    async def _wake_on(self, slot: Slot, name: str, stages: Sequence[str] | None) -> None:
        if name in slot.lost:
            raise TenantLostError(f"{name} cannot wake on slot {slot.index}: it is lost "
                                  f"({slot.lost[name]}). " + _AFTER_LOSS.format(slot=slot.index),
                                  slot.index, tuple(slot.lost))
        handle = slot.tenants[name]
        known = slot.infos[name].stages  # fixed at registration
        unknown = [s for s in stages or () if s not in known]
        if unknown:
            raise ArbiterError(f"{name} has no stage(s) {unknown}; its stages: {known}")
        todo = [s for s in (stages or known) if s not in slot.awake.get(name, ())]
        if not todo:
            return
        needed = 0
        if self.policy.measures:  # the tenant's size matters to the policy
            info = await self._call(f"{name}.describe", handle.describe(), slot, name)
            slot.infos[name] = info
            needed = info.tagged_bytes - info.resident_bytes
        slept: list[tuple[str, tuple[str, ...]]] = []
        try:
            while victim := self.policy.next_victim(
                    name, slot.awake_tenants(), needed, self._free(slot)):
                stages_before = slot.awake[victim]
                await self._sleep_verified(slot, victim, waking=name)
                slept.append((victim, stages_before))
            self._require_room(slot, name, needed)
        except BaseException:
            await self._rewake(slot, slept)
            raise
        try:
            await self._call(f"{name}.wake({todo})", handle.wake(todo), slot, name)
        except BaseException as err:
            await self._undo_wake(slot, name, slept)
            raise self._failed(slot, [name], f"{name} failed to wake {todo}: {err}; rolled "
                               f"back: {slot.who()}") from err
        slot.mark(name, [*slot.awake.get(name, ()), *todo])
        self._check(slot)

    def _require_room(self, slot: Slot, name: str, needed: int) -> None:
        free = self._free(slot)
        if not self.policy.has_room(needed, free):
            room = "the policy finds no room" if free is None \
                else f"it needs {needed} bytes but only {free} are free"
            raise SwitchError(f"{name} cannot wake on slot {slot.index}: {room} after the "
                              f"policy's sleeps: {slot.who()}")

    async def _undo_wake(self, slot: Slot, name: str,
                         slept: list[tuple[str, tuple[str, ...]]]) -> None:
        """After a failed wake: put the tenant back to sleep, then wake whom it displaced."""
        try:
            await self._call(f"{name}.sleep", slot.tenants[name].sleep(None), slot, name)
            slot.mark(name, ())
        except Exception:
            await self._learn(slot, name)
            return  # not known to be asleep: waking the others could break the budget
        await self._rewake(slot, slept)

    async def _rewake(self, slot: Slot, slept: list[tuple[str, tuple[str, ...]]]) -> None:
        for victim, stages in slept:
            try:
                await self._call(f"{victim}.wake", slot.tenants[victim].wake(stages), slot,
                                 victim)
                slot.mark(victim, stages)
            except Exception:
                await self._learn(slot, victim)

    async def _sleep_verified(self, slot: Slot, name: str, waking: str | None = None,
                              stages: Sequence[str] | None = None) -> None:
        """Sleep `name`'s `stages` (default: all) on `slot` and measure that their memory
        came back; else wake them again and raise."""
        handle = slot.tenants[name]
        awake_stages = slot.awake.get(name, ())
        todo = [s for s in awake_stages if stages is None or s in stages]
        if not todo:
            return
        before = self._reading(slot, name, f"{name}.sleep").used_bytes
        not_woken = f"; {waking} was not woken" if waking else ""
        try:
            expected = await self._call(f"{name}.sleep", handle.sleep(
                None if stages is None else todo), slot, name)
        except BaseException as err:
            await self._learn(slot, name)
            raise self._failed(slot, [name], f"{name} failed to sleep on slot {slot.index}: "
                               f"{err}; {slot.who()}{not_woken}") from err
        slot.mark(name, [s for s in awake_stages if s not in todo])
        slot.unknown.discard(name)
        if expected < self.config.min_verified_bytes:
            return
        drop = await self._released(slot, name, before, expected)
        if drop >= self.config.release_fraction * expected:
            return
        await self._rewake(slot, [(name, awake_stages)])
        raise ReleaseNotVerifiedError(
            f"{name} slept on slot {slot.index} but only {drop / 2**20:.1f} of its "
            f"{expected / 2**20:.1f} MiB came back within {self.config.release_timeout_s} s "
            f"(memory held outside its tags?); it was woken again: {slot.who()}{not_woken}")

    # -- handoff: the one moment two tenants are partly awake ----------------------------

    async def handoff(self, source: str, target: str, slots: Iterable[int] | None = None,
                      keep: Sequence[str] = ("weights",), first: Sequence[str] = ("weights",)
                      ) -> int:
        """Pass weights from `source` to `target` on their shared slots, staged: `source`
        sleeps all but `keep`, `target` wakes `first`, `target.receive(source)` copies, then
        `source` sleeps and `target` wakes its other stages. Peak memory: `source`'s kept
        stages + `target`'s first stages, never both tenants whole. Returns bytes copied.

        On failure the slot goes back to `source` awake (as it was) and `target` asleep.
        """
        chosen = self._slots_of(target, slots)
        self._slots_of(source, [s.index for s in chosen])
        async with self._hold(chosen):
            results = await asyncio.gather(
                *(self._handoff_on(slot, source, target, keep, first) for slot in chosen),
                return_exceptions=True)
        self._raise_errors(results, chosen)
        return sum(results)

    async def _handoff_on(self, slot: Slot, source: str, target: str, keep: Sequence[str],
                          first: Sequence[str]) -> int:
        source_stages = slot.awake.get(source, ())
        if not set(keep) <= set(source_stages) or slot.unknown or target in slot.lost:
            raise ArbiterError(f"handoff {source} -> {target} needs {source} awake with "
                               f"{list(keep)} on slot {slot.index}: {slot.who()}")
        for other in slot.awake_tenants():
            if other not in (source, target):
                await self._sleep_verified(slot, other, waking=target)
        await self._sleep_verified(slot, target)
        await self._sleep_verified(slot, source, waking=target,
                                   stages=[s for s in source_stages if s not in keep])
        handle = slot.tenants[target]
        step, copying = f"{target}.wake({list(first)})", False
        try:
            await self._call(step, handle.wake(first), slot, target)
            slot.mark(target, first)
            step, copying = f"{target}.receive({source})", True
            copied = await self._call(step, handle.receive(source), slot, target)
            step, copying = f"{source}.sleep", False
            await self._sleep_verified(slot, source, waking=target)
        except BaseException as err:
            await self._undo_handoff(slot, source, target, source_stages)
            torn = (f"; {target}'s {list(first)} may hold part of {source}'s now: hand off "
                    f"again before {target} serves") if copying else ""
            raise self._failed(slot, [source, target], f"handoff {source} -> {target} failed "
                               f"on slot {slot.index} at {step}: {err}; rolled back: "
                               f"{slot.who()}{torn}") from err
        rest = [s for s in slot.infos[target].stages if s not in first]
        try:
            await self._call(f"{target}.wake({rest})", handle.wake(rest), slot, target)
        except BaseException as err:
            await self._undo_wake(slot, target, [])
            raise self._failed(slot, [target], f"{target} took {source}'s weights but failed "
                               f"to wake {rest} on slot {slot.index}: {err}; {slot.who()}"
                               ) from err
        slot.mark(target, [*first, *rest])
        self._check(slot)
        return copied

    async def _undo_handoff(self, slot: Slot, source: str, target: str,
                            source_stages: tuple[str, ...]) -> None:
        """Target asleep, then source awake as before the handoff."""
        try:
            await self._call(f"{target}.sleep", slot.tenants[target].sleep(None), slot,
                            target)
            slot.mark(target, ())
        except Exception:
            await self._learn(slot, target)
            return
        await self._rewake(slot, [(source, source_stages)])

    # -- queries -----------------------------------------------------------------------

    def tenants(self) -> dict[str, list[int]]:
        found: dict[str, list[int]] = {}
        for slot in self.slots.values():
            for name in slot.tenants:
                found.setdefault(name, []).append(slot.index)
        return found

    def find_lost(self, names: Iterable[str]) -> dict[str, str]:
        """Check now that the procs of `names` run; those that died are lost from here on.
        Returns every lost tenant on the slots of `names`, with why."""
        names = set(names)
        found: dict[str, str] = {}
        for slot in self.slots.values():
            asked = names.intersection(slot.tenants)
            if not asked:
                continue
            for name in asked.difference(slot.lost):
                pid = slot.infos[name].pid
                if not telemetry.process_runs(pid):
                    self._lose(slot, pid, "a liveness check")
            found.update({name: f"{name} lost on slot {slot.index}: {why}"
                          for name, why in slot.lost.items()})
        return found

    def status(self) -> dict[int, dict[str, list[str] | None]]:
        """Per slot: tenant -> its awake stages ([] asleep; None when unknown or lost)."""
        return {
            slot.index: {name: None if name in slot.unknown or name in slot.lost
                         else list(slot.awake.get(name, ()))
                         for name in slot.tenants}
            for slot in self.slots.values()
        }
