"""The tenant protocol: what the arbiter asks of a colocated tenant on one slot.

A tenant sleeps (releases its memory), wakes stage by stage (e.g. "weights" then
"kv_cache"), and describes itself (process, device, bytes per stage). A `Tenancy` is the
object in the tenant's process that does these three; `TenantHandle` is how the arbiter
reaches it (an actor, or an object of the arbiter's own process). `TaggedTenant` is the
default tenancy: each stage is a `colocate.memory` tag of the tenant's process. An engine
with its own sleep (vLLM) has its own tenancy, and a tenant actor delegates to its
engine's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from colocate import memory, telemetry
from colocate.arbiter.errors import UnknownStageError


@dataclass(frozen=True)
class TenantInfo:
    """A tenant's own account of itself on one slot."""

    pid: int
    device: str  # "cpu", or the GPU's UUID
    stages: tuple[str, ...]  # wake order
    awake_stages: tuple[str, ...]
    resident_bytes: int  # held now
    tagged_bytes: int  # held when fully awake
    stage_bytes: Mapping[str, int] = field(default_factory=dict)  # each stage, awake
    kept: tuple[str, ...] = ()  # stages whose contents a sleep copies to host memory
    # kept stages whose owner rewrites them before use: a sleep may drop them instead
    refillable: tuple[str, ...] = ()
    working_bytes: int = 0  # what its calls allocate beyond its stages, declared or learned

    def size(self, stage: str) -> int:
        """The bytes `stage` holds when awake (0 when the tenant does not say)."""
        return self.stage_bytes.get(stage, 0)


class Tenancy(Protocol):
    """The three calls of a tenant, in its own process (`TaggedTenant`, or an engine's)."""

    def sleep(self, stages: Sequence[str] | None = None,
              places: Mapping[str, str] | None = None) -> int:
        """Release `stages` that are awake (default: every stage), each kept one's
        contents at its place in `places` (stage -> "host", "disk" or "drop": the
        arbiter's choice, `host_budget.py`; "host" when not named); returns the bytes they
        held."""
        ...

    def wake(self, stages: Sequence[str]) -> None:
        """Bring `stages` back, in that order; awake stages are left as they are."""
        ...

    def describe(self) -> TenantInfo: ...


class TenantHandle(Protocol):
    """How the arbiter reaches one tenant on one slot (an actor slice, a pipe, an object).

    A handle of a tenant in another process also has `async run_plan(plan) -> PlanResult`
    (`ActorTenantHandle`): the arbiter then sends each switch to that process as one plan
    (colocate.arbiter.plan). Without it (a tenant of the arbiter's own process), the
    arbiter carries out the plan's steps itself through the calls below.
    """

    name: str

    async def sleep(self, stages: Sequence[str] | None = None,
                    places: Mapping[str, str] | None = None) -> int:
        """Release `stages` (default: every stage), kept ones at their `places`; returns
        the bytes they held (what the arbiter expects back)."""
        ...

    async def wake(self, stages: Sequence[str]) -> None:
        """Bring `stages` back, in that order."""
        ...

    async def describe(self) -> TenantInfo: ...

    async def receive(self, source: str) -> int:
        """Copy the weights of tenant `source` (same process) into this tenant's awake
        stages; returns the bytes copied. Only tenants that take weights implement it."""
        ...


@dataclass
class TaggedTenant:
    """The default tenant behaviour: stage -> memory tag of this process.

    `stages` maps each stage to its tag, in wake order; `backup` says per stage whether its
    contents survive a sleep (weights: yes; caches: no); `refillable` names kept stages
    whose owner rewrites them before use (it checks `lost`), which a sleep may drop when
    the host has no room for their backup. `name` is the tenant's name at the
    arbiter, for messages (default: the tags' common prefix, "trainer" for "trainer/weights").
    `working_bytes` is what its calls allocate beyond its stages (activations, a transient
    KV cache): a budget wakes it only with that much free besides.
    """

    stages: Mapping[str, str]
    backup: Mapping[str, bool] = field(default_factory=dict)
    name: str | None = None
    refillable: tuple[str, ...] = ()
    working_bytes: int = 0
    _lost: set[str] = field(default_factory=set, init=False, repr=False)

    def region(self, stage: str, device: str | torch.device | None = None):
        """Allocate the stage's memory inside this block."""
        self._check_stages([stage])
        return memory.region(self.stages[stage], backup=self.backup.get(stage, True),
                             device=device)

    def adopt(self, obj: object, stage: str) -> int:
        self._check_stages([stage])
        return memory.adopt(obj, self.stages[stage], backup=self.backup.get(stage, True))

    @property
    def tenant(self) -> str:
        """The tenant's name at the arbiter (see `name`)."""
        if self.name:
            return self.name
        prefixes = {tag.rpartition("/")[0] for tag in self.stages.values()}
        return prefixes.pop() if len(prefixes) == 1 and "" not in prefixes else "this tenant"

    def _known(self) -> list[str]:
        known = set(memory.tags())
        return [stage for stage, tag in self.stages.items() if tag in known]

    def sleep(self, stages: Sequence[str] | None = None,
              places: Mapping[str, str] | None = None) -> int:
        """Pause `stages` (default: all) that are awake, caches first, each kept one's
        contents at its place in `places` (default: host memory); returns the bytes they
        held. (The sleep also gives back what the allocators keep of the process's freed
        memory, once, after its pauses.)"""
        self._check_stages(stages or ())
        places = places or {}
        dropped = [s for s, p in places.items() if p == memory.DROP and s not in self.refillable
                   and self.backup.get(s, True)]
        if dropped:
            raise ValueError(f"stage(s) {dropped} of {self.tenant} cannot be dropped at a "
                             f"sleep: they are kept and not refillable ({self.refillable})")
        released = 0
        with memory.pausing_together():  # one malloc_trim for the sleep, not one a stage
            for stage in reversed(self._known()):
                if stages is not None and stage not in stages:
                    continue
                tag = self.stages[stage]
                if memory.state(tag) is memory.TagState.ACTIVE:
                    place = places.get(stage, memory.HOST)
                    released += memory.pause(tag, place)  # its bytes, counted once
                    if not self.backup.get(stage, True) or place == memory.DROP:
                        self._lost.add(stage)
        return released

    def lost(self, stage: str) -> bool:
        """Whether `stage` (one without backup) lost its contents at a sleep since it was
        last `refilled`."""
        self._check_stages([stage])
        return stage in self._lost

    def refilled(self, stage: str) -> None:
        """Say that `stage` holds good contents again (new weights were written into it)."""
        self._check_stages([stage])
        self._lost.discard(stage)

    def wake(self, stages: Sequence[str]) -> None:
        """Resume `stages` in order (stages with no memory yet need nothing)."""
        self._check_stages(stages)
        known = set(memory.tags())
        for stage in stages:
            tag = self.stages[stage]
            if tag in known and memory.state(tag) is memory.TagState.PAUSED:
                memory.resume(tag)

    def _check_stages(self, stages: Sequence[str]) -> None:
        unknown = [stage for stage in stages if stage not in self.stages]
        if unknown:
            what = f"stage {unknown[0]!r}" if len(unknown) == 1 else f"stages {unknown}"
            raise UnknownStageError(f"unknown {what}; stages: {list(self.stages)}")

    def ensure_stage(self, stage: str) -> None:
        """Raise `TagPausedError` unless `stage` is awake."""
        self._check_stages([stage])
        if self.stages[stage] in memory.tags():
            self._ensure_active(stage)

    def ensure_awake(self) -> None:
        """Raise `TagPausedError` unless every stage is awake: call before computing."""
        for stage in self._known():
            self._ensure_active(stage)

    def _ensure_active(self, stage: str) -> None:
        """The tag's check, with a message at the tenant's level: how to wake it (through
        the arbiter), not the low-level `resume` of its tag."""
        try:
            memory.ensure_active(self.stages[stage])
        except memory.TagPausedError:
            name = self.tenant
            raise memory.TagPausedError(
                f"tenant {name!r} is asleep (its stage {stage!r} is paused): wake it first, "
                f"with `async with phase({name!r}):` around the calls or "
                f"`await rm.wake({name!r})` (a service: `phase(service)`)") from None

    def awake_stages(self) -> tuple[str, ...]:
        """The stages awake now, in wake order (a stage with no memory yet counts as awake)."""
        known = set(self._known())
        return tuple(s for s in self.stages if s not in known
                     or memory.state(self.stages[s]) is memory.TagState.ACTIVE)

    def describe(self) -> TenantInfo:
        known = self._known()
        return TenantInfo(
            pid=os.getpid(),
            device=_device(),
            stages=tuple(self.stages),
            awake_stages=self.awake_stages(),
            resident_bytes=sum(memory.resident_bytes(self.stages[s]) for s in known),
            tagged_bytes=sum(memory.tagged_bytes(self.stages[s]) for s in known),
            stage_bytes={s: memory.tagged_bytes(self.stages[s]) if s in known else 0
                         for s in self.stages},
            kept=tuple(s for s in self.stages if self.backup.get(s, True)),
            refillable=tuple(s for s in self.refillable if self.backup.get(s, True)),
            working_bytes=self.working_bytes,
        )


def _device() -> str:
    if torch.cuda.is_available():
        return telemetry.device_uuid(torch.cuda.current_device())
    return "cpu"
