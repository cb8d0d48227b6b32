"""A host's memory budget for the backups its switches make: where each stage a sleep
keeps goes, and what those backups hold.

The arbiter of a host counts the bytes that its slots' sleeping stages keep in host
memory (`HostLedger`) against the host's capacity for them (`ArbiterConfig.
host_capacity_bytes`; by default `host_capacity()`: the cgroup's memory limit less what the
cgroup uses, where there is a limit, else the host's MemAvailable, when the arbiter
starts). Before a plan runs, each stage its sleeps keep gets a place (`choose`): host
memory while the backups fit; when they would not, first the stages that need no copy
(`TenantInfo.refillable`: kept stages whose owner rewrites them before use, as a generator's
weights the next sync overwrites) are dropped, then the fewest bytes that make the rest fit
go to disk (the backup directory, `ArbiterConfig.backup_dir`), and when even the disk has
no room the switch is refused (`HostMemoryError`, naming the bytes needed and free) before
anything moved. A stage has at most one backup: a stage asleep is not slept again, and the
ledger refuses to count one twice.

The procs measure what their backups really hold (`colocate.memory.backup_reading`), and
each plan's answer carries it: `HostLedger.observe` keeps the host's measured peak, which
`summary()` reports beside the counted one and the capacity.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from colocate.arbiter.errors import ArbiterError, HostMemoryError
from colocate.arbiter.plan import SLEEP, WAKE, Step
from colocate.arbiter.policy import Resident, fewest_bytes
from colocate.arbiter.slot import Slot
from colocate.memory import DISK, DROP, HOST, BackupReading
from colocate.memory.backups import backup_directory

Key = tuple[int, str, str]  # slot, tenant, stage


@dataclass(frozen=True)
class Backup:
    """A stage that a switch's sleep keeps: its bytes, and whether its owner can refill it
    (then dropping it needs no copy)."""

    slot: int
    tenant: str
    stage: str
    nbytes: int
    refillable: bool = False

    @property
    def key(self) -> Key:
        return self.slot, self.tenant, self.stage


def host_capacity(cgroup: Path = Path("/sys/fs/cgroup"),
                  meminfo: Path = Path("/proc/meminfo")) -> int:
    """What the host has available for backups now: within a cgroup v2 memory limit, the
    limit less the cgroup's usage; else MemAvailable."""
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            return max(0, int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ArbiterError(f"no MemAvailable in {meminfo}: give the host's capacity for "
                       "backups (ArbiterConfig.host_capacity_bytes)")


def choose(backups: Sequence[Backup], held: int, capacity: int | None,
           disk_free: int | None, directory: str = "") -> dict[Key, str]:
    """A place (`HOST`, `DISK` or `DROP`) for each of `backups`, with `held` bytes of host
    memory already held by backups out of `capacity` (None: no budget) and `disk_free`
    bytes free in `directory` (None: not measured). See the module for the order; raises
    `HostMemoryError` when they fit nowhere."""
    places = {b.key: HOST for b in backups}
    need = sum(b.nbytes for b in backups)
    if capacity is None or held + need <= capacity:
        return places
    deficit = held + need - capacity
    for b in backups:  # no copy first
        if deficit > 0 and b.refillable and b.nbytes > 0:
            places[b.key], deficit = DROP, deficit - b.nbytes
    if deficit <= 0:
        return places
    copies = [Resident(b.tenant, b.stage, b.nbytes, True) for b in backups
              if places[b.key] == HOST and b.nbytes > 0]
    slot = backups[0].slot
    to_disk = fewest_bytes(copies, deficit) if sum(r.nbytes for r in copies) >= deficit \
        else []
    disk_need = sum(r.nbytes for r in to_disk)
    if not to_disk or (disk_free is not None and disk_need > disk_free):
        free = max(0, capacity - held)
        where = "the host already holds more than its capacity in backups" if not to_disk \
            else f"the backup directory {directory} has {disk_free} bytes free of the " \
                 f"{disk_need} the rest would take there"
        raise HostMemoryError(
            f"a switch on slot {slot} must back up {need} bytes "
            f"({', '.join(f'{b.tenant}/{b.stage}: {b.nbytes}' for b in backups)}) but only "
            f"{free} of the host's {capacity} bytes for backups are free ({held} held by "
            f"the backups of sleeping stages or given to switches under way), and {where}. "
            "Raise the host's capacity for "
            "backups (run.host_memory; ArbiterConfig.host_capacity_bytes), set the backup "
            "directory to a disk with room (run.backup_dir; ArbiterConfig.backup_dir), or "
            "give the slots more memory (run.slot_memory) so that fewer stages sleep "
            "(run.policy=exclusive sleeps every stage: more backups, not fewer)",
            need, free)
    for r in to_disk:
        places[slot, r.tenant, r.stage] = DISK
    return places


class HostLedger:
    """The backups of one host's sleeping stages, counted and measured (see module)."""

    def __init__(self, capacity: int | None, backup_dir: str | None) -> None:
        self.capacity = capacity
        self.backup_dir = backup_dir
        self.entries: dict[Key, tuple[str, int]] = {}  # a sleeping kept stage: place, bytes
        # slot -> host bytes its plan in flight was given (the slots of a host switch at
        # once: each plan's backups are counted from its placing, not only once it is done)
        self.pending: dict[int, int] = {}
        self.peak_counted = 0  # the most host bytes counted held at once
        self.measured: dict[int, BackupReading] = {}  # pid -> its last reading
        self.peak_measured = 0  # the most host bytes the procs' backups held at once
        self.peak_disk = 0  # the most bytes the procs' backups held on disk at once

    def held(self, place: str = HOST) -> int:
        return sum(n for p, n in self.entries.values() if p == place)

    def committed(self) -> int:
        """The host bytes counted held, and given to the plans in flight."""
        return self.held() + sum(self.pending.values())

    def unsure(self, slot: Slot, steps: list[Step]) -> bool:
        """Whether the sizes the arbiter last heard may be too old to place `steps`'
        backups: the host's budget is finite and the tenants they sleep could not keep all
        their awake kept stages hold and may grow to (their working memory) within what is
        free.
        Then the tenants are asked first (a stage grows as its tenant works: AdamW's
        state appears at the first step)."""
        if self.capacity is None:
            return False
        self.pending.pop(slot.index, None)  # a plan of its slot that never answered
        sleepers = {s.tenant for s, slept in _walk(slot, steps) if slept}
        bound = sum(sum(i.size(s) for s in i.kept if s in slot.awake.get(n, ()))
                    + i.working_bytes + slot.extra_need.get(n, 0)
                    for n, i in slot.infos.items() if n in sleepers)
        return self.committed() + bound > self.capacity

    def place(self, slot: Slot, steps: list[Step]) -> list[Step]:
        """`steps` with a place for each stage their sleeps keep (`choose`)."""
        self.pending.pop(slot.index, None)  # one plan a slot at a time: an older one is over
        walk = _walk(slot, steps)
        backups = [Backup(slot.index, s.tenant, stage, slot.infos[s.tenant].size(stage),
                          stage in slot.infos[s.tenant].refillable)
                   for s, slept in walk for stage in slept
                   if stage in slot.infos[s.tenant].kept]
        if not backups:
            return steps
        directory = backup_directory(self.backup_dir)
        places = choose(backups, self.committed(), self.capacity, _disk_free(directory),
                        directory)
        self.pending[slot.index] = sum(b.nbytes for b in backups if places[b.key] == HOST)
        return [replace(s, places=tuple(
            (stage, places[slot.index, s.tenant, stage]) for stage in slept
            if places.get((slot.index, s.tenant, stage), HOST) != HOST))  # host: the default
            if s.op == SLEEP else s for s, slept in walk]

    def settle(self, slot: Slot, done: Sequence[Step]) -> None:
        """Count what the plan's `done` steps did (before the slot records them); its
        slot's plan is no longer in flight."""
        self.pending.pop(slot.index, None)
        for step, slept in _walk(slot, done):
            if step.op == SLEEP:
                places = dict(step.places)
                for stage in slept:
                    if stage in slot.infos[step.tenant].kept:
                        self._add((slot.index, step.tenant, stage), places.get(stage, HOST),
                                  slot.infos[step.tenant].size(stage))
            elif step.op == WAKE:
                for stage in step.stages or ():
                    self.entries.pop((slot.index, step.tenant, stage), None)
        self.peak_counted = max(self.peak_counted, self.held())

    def _add(self, key: Key, place: str, nbytes: int) -> None:
        if key in self.entries:
            raise ArbiterError(f"{key[1]}/{key[2]} on slot {key[0]} already has a backup "
                               f"({self.entries[key][0]}): a stage is never backed up twice")
        self.entries[key] = (place, 0 if place == DROP else nbytes)

    def resync(self, slot: Slot) -> None:
        """After a rollback: the slot's stages as its tenants said (a stage awake has no
        backup; a kept one asleep that had none was slept by the rollback, to host)."""
        for name, info in slot.infos.items():
            awake = slot.awake.get(name, ())
            for stage in info.stages:
                key = (slot.index, name, stage)
                if stage in awake or name in slot.lost:
                    self.entries.pop(key, None)
                elif stage in info.kept and key not in self.entries:
                    self.entries[key] = (HOST, info.size(stage))
        self.peak_counted = max(self.peak_counted, self.held())

    def forget(self, slot: int, tenant: str) -> None:
        for key in [k for k in self.entries if k[:2] == (slot, tenant)]:
            del self.entries[key]

    def observe(self, readings: Mapping[int, BackupReading]) -> None:
        """Take the procs' readings from a plan's answer (`PlanResult.backups`)."""
        for pid, reading in readings.items():
            others = [r for p, r in self.measured.items() if p != pid]
            self.peak_measured = max(self.peak_measured, reading.peak_host_bytes
                                     + sum(r.host_bytes for r in others))
            self.measured[pid] = reading
        self.peak_disk = max(self.peak_disk, sum(r.disk_bytes for r in self.measured.values()))

    def summary(self) -> dict[str, int | str | None]:
        """The capacity, the peaks (measured, counted, on disk) and what is held now."""
        return {"host_capacity_bytes": self.capacity,
                "peak_backup_bytes": self.peak_measured,
                "peak_counted_backup_bytes": self.peak_counted,
                "peak_disk_backup_bytes": self.peak_disk,
                "backup_bytes": self.held(), "disk_backup_bytes": self.held(DISK),
                "backup_dir": backup_directory(self.backup_dir)}


def _walk(slot: Slot, steps: Sequence[Step]) -> list[tuple[Step, list[str]]]:
    """Each step with the stages it releases (a sleep: those of its stages awake by then,
    as the steps before it in the plan leave the slot; other steps: none)."""
    awake = {name: list(stages) for name, stages in slot.awake.items()}
    found = []
    for step in steps:
        mine = awake.setdefault(step.tenant, [])
        slept = [s for s in mine if step.op == SLEEP and (step.stages is None
                                                           or s in step.stages)]
        if step.op == WAKE:
            mine += [s for s in step.stages or () if s not in mine]
        awake[step.tenant] = [s for s in mine if s not in slept]
        found.append((step, slept))
    return found


def _disk_free(directory: str) -> int:
    """The bytes free in `directory`; 0 where it cannot be read (it does not exist)."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return 0
