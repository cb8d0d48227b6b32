"""What each switch of a step will move on one slot, known before anything runs.

The decisions are the arbiter's own: a `SlotArbiter` (core.py, with its policy, room.py
and handoff_plan.py) is driven through the step's turns against tenants that exist only as
byte counts (`_Counted`), on a slot of the declared capacity. So the plan and the real
switches cannot disagree about what sleeps: they are one code. What the client does
without the arbiter is mirrored here as `ResourceManager` and `Handoffs` do it: a wake of
a tenant that already holds its slot costs nothing, and a sync on a roomy slot is the copy
alone, in place (`room.roomy`).

    tenants = [TenantSpec("trainer", {"weights": (w, True), "optimizer": (2 * w, True),
                                      "grads": (w, False)}),
               TenantSpec("generator", {"weights": (w, False)}, working_bytes=kv)]
    step = [Wake("generator"), Wake("trainer"), Sync("trainer", "generator")]
    found = forecast_slot(tenants, step, capacity, start=[Sync("trainer", "generator")])
    found.step  # the steady step's switches: what slept, bytes out and in, the peak

A tenant is registered awake, whole, as a spawned one is (one that may not stay awake
beside the others sleeps at once, as `SlotArbiter.register` does); the `start` turns run
once, then the step's turns `steps` times: the first step and the last (the steady one)
are kept.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from colocate import memory
from colocate.arbiter import room
from colocate.arbiter.config import ArbiterConfig
from colocate.arbiter.core import SlotArbiter
from colocate.arbiter.errors import ArbiterError
from colocate.arbiter.policy import Policy
from colocate.arbiter.tenant import TenantInfo
from colocate.sync_bridge import run_sync

# releases are never measured in a forecast: nothing is held to measure
UNMEASURED = 1 << 62


@dataclass(frozen=True)
class TenantSpec:
    """One tenant on one slot: stage -> (bytes, kept across a sleep: copied to host memory
    and back; else dropped), in wake order, the working memory its calls take, and stage ->
    how many tensors it is (each costs a switch a little of its own; absent: 0)."""

    name: str
    stages: Mapping[str, tuple[int, bool]]
    working_bytes: int = 0
    tensors: Mapping[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(b for b, _ in self.stages.values()) + self.working_bytes


@dataclass(frozen=True)
class Wake:
    """A turn: `tenant` awake, holding the slot for its calls (`phase(tenant)`)."""

    tenant: str

    def label(self) -> str:
        return f"wake {self.tenant}"


@dataclass(frozen=True)
class Sync:
    """A turn: `source`'s weights copied into `target` (`services.sync_weights`)."""

    source: str
    target: str
    keep: tuple[str, ...] = ("weights",)
    first: tuple[str, ...] = ("weights",)

    def label(self) -> str:
        return f"sync {self.source} -> {self.target}"


Turn = Wake | Sync


@dataclass(frozen=True)
class Moved:
    """One stage that slept or woke in a switch."""

    tenant: str
    stage: str
    nbytes: int
    copied: bool  # to (or from) its backup; else dropped (or refilled empty)
    place: str = memory.HOST  # a copied stage's backup: host memory, or disk
    tensors: int = 0


@dataclass
class Switch:
    """One turn's switch on the slot: how it goes (`way`: "none", nothing to do;
    "arbiter", the arbiter's plans; "in_place", the sync's copy alone), the stages that
    slept and woke, the bytes copied to host memory and back, dropped, and copied within
    the slot (a sync's weights, and their tensors), what the slot held after it with the
    awake tenant's working memory (counted as the arbiter counts its peak: after its
    measured wakes and handoffs; else 0), and the most host copies held during it (its
    sleeps copy out before its wakes copy back)."""

    turn: str
    way: str
    slept: list[Moved] = field(default_factory=list)
    woken: list[Moved] = field(default_factory=list)
    in_slot_bytes: int = 0
    peak_bytes: int = 0
    backup_bytes: int = 0
    in_slot_tensors: int = 0

    @property
    def tensors(self) -> int:
        """The tensors the switch handles: each stage's that slept or woke, and the sync's."""
        return sum(m.tensors for m in self.slept + self.woken) + self.in_slot_tensors

    @property
    def copied_out(self) -> int:
        return sum(m.nbytes for m in self.slept if m.copied)

    @property
    def copied_in(self) -> int:
        return sum(m.nbytes for m in self.woken if m.copied)

    @property
    def to_disk(self) -> int:
        """Of `copied_out`, the bytes that went to disk (the host's budget was short)."""
        return sum(m.nbytes for m in self.slept if m.copied and m.place == memory.DISK)

    @property
    def from_disk(self) -> int:
        return sum(m.nbytes for m in self.woken if m.copied and m.place == memory.DISK)

    @property
    def disk_stages(self) -> int:
        """The stages that went to disk or came back from it (a backup file each)."""
        return sum(1 for m in self.slept + self.woken if m.copied and m.place == memory.DISK)

    @property
    def discarded(self) -> int:
        return sum(m.nbytes for m in self.slept if not m.copied)

    @property
    def refilled(self) -> int:
        return sum(m.nbytes for m in self.woken if not m.copied)


@dataclass
class SlotForecast:
    """A slot's switches: at the start, in the first step and in the steady step; `fits`
    False with `why` when a turn could not be made (the arbiter's own error)."""

    capacity: int | None
    tenants: list[TenantSpec]
    start: list[Switch] = field(default_factory=list)
    first_step: list[Switch] = field(default_factory=list)
    step: list[Switch] = field(default_factory=list)
    fits: bool = True
    why: str = ""

    def moved_per_step(self) -> int:
        """Bytes copied to host memory and back in the steady step."""
        return sum(s.copied_out + s.copied_in for s in self.step)

    def peak_bytes(self) -> int:
        """The most the slot held after a switch, over every switch forecast."""
        return max((s.peak_bytes for s in self.start + self.first_step + self.step),
                   default=0)

    def backup_peak_bytes(self) -> int:
        """The most host memory the slot's backups held at once."""
        return max((s.backup_bytes for s in self.start + self.first_step + self.step),
                   default=0)


class _Counted:
    """A tenant that is only its byte counts: its sleeps and wakes are recorded, nothing is
    held (a `TenantHandle` for the arbiter)."""

    def __init__(self, spec: TenantSpec, log: list[Moved]) -> None:
        self.name, self.spec, self.log = spec.name, spec, log
        self.awake = list(spec.stages)
        self.places: dict[str, str] = {}  # a sleeping stage's backup

    async def sleep(self, stages: Sequence[str] | None = None,
                    places: Mapping[str, str] | None = None) -> int:
        going = [s for s in reversed(self.awake) if stages is None or s in stages]
        for stage in going:
            nbytes, kept = self.spec.stages[stage]
            place = (places or {}).get(stage, memory.HOST)
            self.places[stage] = place
            self.log.append(Moved(self.name, stage, nbytes, kept and place != memory.DROP,
                                  place, self.spec.tensors.get(stage, 0)))
        self.awake = [s for s in self.awake if s not in going]
        return sum(self.spec.stages[s][0] for s in going)

    async def wake(self, stages: Sequence[str]) -> None:
        for stage in stages:
            if stage not in self.awake:
                nbytes, kept = self.spec.stages[stage]
                place = self.places.pop(stage, memory.HOST)
                self.log.append(Moved(self.name, stage, -nbytes,  # negative: woken
                                      kept and place != memory.DROP, place,
                                      self.spec.tensors.get(stage, 0)))
                self.awake.append(stage)
        self.awake = [s for s in self.spec.stages if s in self.awake]

    async def receive(self, source: str) -> int:
        return self.spec.stages.get("weights", (0, True))[0]

    async def describe(self) -> TenantInfo:
        bytes_ = {s: b for s, (b, _) in self.spec.stages.items()}
        return TenantInfo(pid=os.getpid(), device="cpu", stages=tuple(self.spec.stages),
                          awake_stages=tuple(self.awake),
                          resident_bytes=sum(bytes_[s] for s in self.awake),
                          tagged_bytes=sum(bytes_.values()), stage_bytes=bytes_,
                          kept=tuple(s for s, (_, k) in self.spec.stages.items() if k),
                          working_bytes=self.spec.working_bytes)


class _Simulation:
    """One slot's arbiter and its counted tenants, taking turns."""

    def __init__(self, tenants: Sequence[TenantSpec], capacity: int | None,
                 policy: str | Policy, host_capacity: int | None = None,
                 backup_dir: str | None = None) -> None:
        # the host's budget for backups is the one given, never this machine's memory (a
        # plan for a bigger node is made on a laptop): without one, every kept stage goes
        # to host memory, and the plan holds their peak against the host's capacity
        self.arbiter = SlotArbiter([0], ArbiterConfig(
            policy=policy, slot_capacity_bytes=capacity, min_verified_bytes=UNMEASURED,
            host_capacity_bytes=UNMEASURED if host_capacity is None else host_capacity,
            backup_dir=backup_dir))
        self.log: list[Moved] = []
        self.tenants = {t.name: _Counted(t, self.log) for t in tenants}
        self.backup = 0  # host copies held now

    @property
    def slot(self):  # noqa: ANN201 (the arbiter's Slot)
        return self.arbiter.slots[0]

    async def register(self) -> Switch:
        for tenant in self.tenants.values():
            await self.arbiter.register(0, tenant)
        return self._switch("spawn", "arbiter", 0, None)

    async def turn(self, turn: Turn) -> Switch:
        slot, arbiter = self.slot, self.arbiter
        measures = arbiter.policy.measures
        names = [turn.tenant] if isinstance(turn, Wake) else [turn.source, turn.target]
        here = [name for name in names if name in slot.infos]
        if isinstance(turn, Wake) or len(here) < len(names):  # a sync between slots apart:
            return await self._wake(turn.label(), here)  # the side here awake for the copy
        source, target = turn.source, turn.target
        if measures and room.roomy(slot, arbiter.config, arbiter.policy) \
                and set(slot.awake.get(target, ())) >= set(slot.infos[target].stages) \
                and set(slot.awake.get(source, ())) >= set(turn.keep):
            copied = await self.tenants[target].receive(source)  # Handoffs: in place
            return self._switch(turn.label(), "in_place", copied, None, target)
        copied = await arbiter.handoff(source, target, [0], turn.keep, turn.first)
        return self._switch(turn.label(), "arbiter", copied, target, target)

    async def _wake(self, label: str, names: list[str]) -> Switch:
        """Wake `names[0]` (none: a tenant on other slots, nothing to do here)."""
        slot, arbiter = self.slot, self.arbiter
        if not names:
            return self._switch(label, "none", 0, None)
        name = names[0]
        whole = set(slot.awake.get(name, ())) >= set(slot.infos[name].stages)
        holds = not arbiter.policy.measures or not slot.infos[name].working_bytes \
            or slot.holder == name or room.roomy(slot, arbiter.config, arbiter.policy)
        if whole and holds:  # ResourceManager.wake: nothing to do
            return self._switch(label, "none", 0, None)
        await arbiter.wake(name)
        return self._switch(label, "arbiter", 0, name)

    def _switch(self, label: str, way: str, copied: int, holder: str | None,
                synced: str | None = None) -> Switch:
        """The switch just made; `synced`: the tenant whose weights a sync copied."""
        slept = [m for m in self.log if m.nbytes >= 0]
        woken = [replace(m, nbytes=-m.nbytes) for m in self.log if m.nbytes < 0]
        self.log.clear()
        tensors = self.tenants[synced].spec.tensors.get("weights", 0) if synced and copied \
            else 0
        found = Switch(label, way, slept, woken, copied, in_slot_tensors=tensors)
        # host copies held: its sleeps copy out first
        out, back = found.copied_out - found.to_disk, found.copied_in - found.from_disk
        found.backup_bytes = self.backup + out
        self.backup += out - back
        if holder is not None and self.arbiter.policy.measures:  # as `_note_peak` counts
            found.peak_bytes = room.used_bytes(self.slot, holder)
        return found


def forecast_slot(tenants: Sequence[TenantSpec], step: Sequence[Turn],
                  capacity: int | None, policy: str | Policy = "budget",
                  start: Sequence[Turn] = (), steps: int = 3,
                  host_capacity: int | None = None, backup_dir: str | None = None
                  ) -> SlotForecast:
    """The switches of `step`'s turns on a slot of `capacity` bytes holding `tenants`
    (registered in that order), under `policy`, after the `start` turns (see module); with
    `host_capacity`, the slot's backups get that much host memory, and what does not fit
    goes to disk (`backup_dir`) as the arbiter's host budget decides. Callable from inside
    a running event loop too (it runs on a thread of its own then)."""
    return run_sync(_forecast(list(tenants), list(step), capacity, policy, list(start),
                              steps, host_capacity, backup_dir))


async def _forecast(tenants: list[TenantSpec], step: list[Turn], capacity: int | None,
                    policy: str | Policy, start: list[Turn], steps: int,
                    host_capacity: int | None, backup_dir: str | None) -> SlotForecast:
    found = SlotForecast(capacity, tenants)
    if capacity is None and policy == "budget":
        found.fits, found.why = False, "the budget policy needs a slot capacity"
        return found
    sim = _Simulation(tenants, capacity, policy, host_capacity, backup_dir)
    try:
        found.start.append(await sim.register())
        found.start += [await sim.turn(t) for t in start]
        for index in range(max(1, steps)):
            switches = [await sim.turn(t) for t in step]
            if index == 0:
                found.first_step = switches
            found.step = switches
    except ArbiterError as err:
        found.fits, found.why = False, str(err)
    return found
