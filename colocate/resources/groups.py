"""Resource groups and allocations: which procs each owner (a tenant, a service replica)
gets.

A resource group is placed once (first-fit GPUs, `packing`) and gets one proc per GPU
(`procs.spawn_slot_procs`). Every allocation in the group is a slice of those procs, so the
services of a group share processes, CUDA contexts and torch_memory_saver. An owner never
gets the same proc twice; different owners share procs. Procs that died are replaced for
the same slots (`replace`), and the replacement is an allocation of its own; the dead
procs' shared-memory files go then (`shm_files`). A whole group can get new procs too
(`restart`: every proc replaced, the owners' allocations `reslice`d onto them), so tenants
that shared a process share one again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from colocate.resources.packing import Inventory, Placement, ResourceError, ResourceRequest
from colocate.resources.procs import SlotProcs, select, spawn_slot_procs, stop_procs
from colocate.shm_files import remove_files_of

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Allocation:
    """Procs of a resource group given to one owner (a service replica, a tenant).

    `slots` lists (host, slot) per proc in mesh order; `procs` is the Monarch proc mesh
    slice with dims (hosts, gpus); `pids` the procs' process ids, in the same order.
    `replacement` is True for new procs started for the slots of procs that died
    (`Groups.replace`): the owner still holds the group's cells for those slots through
    its first allocation. `timeshared` is False in a group placed without GPUs: its procs
    take no slot, so their tenants never take turns with a GPU's (or a CPU slot's) tenants.
    """

    group: str
    owner: str
    procs: Any
    slots: tuple[tuple[int, int], ...]
    hosts: int
    procs_per_host: int
    replacement: bool = False
    pids: tuple[int, ...] = ()
    timeshared: bool = True

    def host_pids(self) -> tuple[tuple[int, int], ...]:
        """(host, pid) of each of its procs, in mesh order."""
        return tuple((host, pid) for (host, _), pid in zip(self.slots, self.pids, strict=True))


@dataclass
class Group:
    """A placed resource group: its GPUs, its procs, and which owner uses which of them."""

    placement: Placement
    procs: Any  # ProcMesh with dims (hosts, gpus)
    pids: tuple[int, ...]
    here: tuple[int, ...]  # those of `pids` that run on this machine
    used: dict[str, set[tuple[int, int]]] = field(default_factory=dict)  # owner -> (h, g)

    def slot_procs(self) -> SlotProcs:
        return SlotProcs(self.procs, self.pids, self.here)

    def slot(self, host: int, proc: int) -> tuple[int, int]:
        """The (host, slot) of the group's proc at local coordinates (host, proc)."""
        gpus = self.placement.gpus[host]
        return self.placement.hosts[host], gpus[proc] if gpus else proc

    def slots(self) -> set[tuple[int, int]]:
        """Every (host, slot) of the group."""
        return {self.slot(h, p) for h in range(len(self.placement.hosts))
                for p in range(self.placement.procs_per_host)}

    def host_pids(self) -> set[tuple[int, int]]:
        """(host, pid) of every proc of the group (`pids` is in mesh order, host-major)."""
        per_host = self.placement.procs_per_host
        return {(self.placement.hosts[i // per_host], pid) for i, pid in enumerate(self.pids)}


class Groups:
    """The placed resource groups of one runtime and the procs they started."""

    def __init__(self, host_mesh: Any, inventory: Inventory, virtual: bool,
                 fork_server: str | None = None) -> None:
        self.host_mesh = host_mesh
        self.inventory = inventory
        self.virtual = virtual
        self.fork_server = fork_server  # where procs are forked from (`zygote`), if anywhere
        self.groups: dict[str, Group] = {}
        self.replacements: list[SlotProcs] = []  # procs started for slots whose procs died

    def get(self, name: str) -> Group:
        """The group `name`; ResourceError naming the groups there are if it is unknown."""
        if name not in self.groups:
            raise ResourceError(f"unknown resource group {name!r}; groups: {sorted(self.groups)}")
        return self.groups[name]

    async def reserve(self, request: ResourceRequest) -> Group:
        """Place the group and start its procs: one per GPU (or virtual slot)."""
        placement = self.inventory.place(request)
        try:
            started = await self._start_procs(placement)
        except BaseException:
            self.inventory.release(request.resource_group)
            raise
        group = Group(placement, started.procs, started.pids, started.here)
        self.groups[request.resource_group] = group
        logger.info("resource group %r on hosts %s, gpus %s", request.resource_group,
                    placement.hosts, placement.gpus)
        return group

    def _start_procs(self, placement: Placement) -> Awaitable[SlotProcs]:
        """One proc per GPU (or virtual slot) of a placement."""
        return spawn_slot_procs(
            self.host_mesh, placement.hosts[0], len(placement.hosts), placement.procs_per_host,
            lambda h, p: placement.gpus[h][p] if placement.gpus[h] else p,
            self.virtual or not placement.with_gpus, self.fork_server)

    async def restart(self, name: str, grace_s: float) -> tuple[Group, SlotProcs]:
        """New procs for every slot of group `name` (same hosts, slots and GPUs), then the
        old ones killed (their work is abandoned: forget what ran there first) and their
        shared-memory files removed. Owners keep their cells: `reslice` gives an allocation
        of them on the new procs. Returns the group and its old procs.

        Cancelled (a shutdown) while the new procs start, it lets them start and stops
        them, so none is left that nobody owns."""
        group = self.get(name)
        old = group.slot_procs()
        starting = asyncio.ensure_future(self._start_procs(group.placement))
        try:
            started = await asyncio.shield(starting)
        except asyncio.CancelledError:
            try:
                await stop_procs(await starting, grace_s, kill_first=True)
            except Exception as err:
                logger.warning("group %r: new procs of a cancelled restart: %s", name, err)
            raise
        group.procs, group.pids, group.here = started.procs, started.pids, started.here
        await stop_procs(old, grace_s, kill_first=True)
        return group, old

    def reslice(self, allocation: Allocation) -> Allocation:
        """`allocation`'s cells (its owner still holds them) on the group's procs now: after
        `restart`, or instead of the replacement procs of some of them."""
        group = self.get(allocation.group)
        shape = group.placement
        cells = sorted((h, p) for h in range(len(shape.hosts))
                       for p in range(shape.procs_per_host)
                       if group.slot(h, p) in allocation.slots)
        hosts = sorted({h for h, _ in cells})
        gpus = sorted({p for _, p in cells})
        procs = select(group.procs, hosts=slice(hosts[0], hosts[-1] + 1),
                       gpus=slice(gpus[0], gpus[-1] + 1))
        return Allocation(allocation.group, allocation.owner, procs,
                          tuple(group.slot(h, p) for h, p in cells), allocation.hosts,
                          allocation.procs_per_host,
                          pids=tuple(group.pids[h * shape.procs_per_host + p] for h, p in cells),
                          timeshared=allocation.timeshared)

    async def allocate(self, request: ResourceRequest, owner: str) -> Allocation:
        """A slice of the group's procs for `owner`, first fit among the procs that `owner`
        does not use yet. The group is reserved with the request's shape if it is new."""
        group = self.groups.get(request.resource_group) or await self.reserve(request)
        shape = group.placement
        if request.hosts > len(shape.hosts) or request.procs_per_host > shape.procs_per_host:
            raise ResourceError(
                f"resource group {request.resource_group!r} has {len(shape.hosts)} host(s) x "
                f"{shape.procs_per_host} procs; {owner!r} asks for {request.hosts} x "
                f"{request.procs_per_host}. Reserve the group larger first "
                "(rm.reserve(ResourceRequest(...)) with the largest shape).")
        used = group.used.setdefault(owner, set())
        for h0 in range(len(shape.hosts) - request.hosts + 1):
            for p0 in range(shape.procs_per_host - request.procs_per_host + 1):
                cells = {(h, p) for h in range(h0, h0 + request.hosts)
                         for p in range(p0, p0 + request.procs_per_host)}
                if cells & used:
                    continue
                used |= cells
                procs = select(group.procs, hosts=slice(h0, h0 + request.hosts),
                               gpus=slice(p0, p0 + request.procs_per_host))
                slots = tuple(group.slot(h, p) for h, p in sorted(cells))
                pids = tuple(group.pids[h * shape.procs_per_host + p] for h, p in sorted(cells))
                return Allocation(request.resource_group, owner, procs, slots,
                                  request.hosts, request.procs_per_host, pids=pids,
                                  timeshared=shape.with_gpus)
        raise ResourceError(
            f"{owner!r} already uses every proc of resource group {request.resource_group!r} "
            f"that a {request.hosts} x {request.procs_per_host} slice could take; release one "
            "of its allocations or reserve a larger group.")

    def free(self, allocation: Allocation) -> None:
        """Give the group's procs at an allocation's slots back to its owner's pool (the
        group keeps them). An allocation of a group released since is nothing to free."""
        group = self.groups.get(allocation.group)
        if group is None:
            return
        cells = {(h, p) for h in range(len(group.placement.hosts))
                 for p in range(group.placement.procs_per_host)
                 if group.slot(h, p) in allocation.slots}
        group.used.get(allocation.owner, set()).difference_update(cells)

    async def replace(self, allocation: Allocation) -> Allocation:
        """New procs for the slots of an allocation whose procs died (same hosts, same
        slots and CUDA_VISIBLE_DEVICES); the shared-memory files the dead ones recorded
        are removed (`shm_files`). The group's other procs are left as they are."""
        group = self.get(allocation.group)
        hosts = sorted({h for h, _ in allocation.slots})
        slots, per_host = allocation.slots, allocation.procs_per_host
        started = await spawn_slot_procs(
            self.host_mesh, hosts[0], hosts[-1] - hosts[0] + 1, per_host,
            lambda h, p: slots[h * per_host + p][1],
            self.virtual or not group.placement.with_gpus, self.fork_server)
        self.replacements.append(started)
        here = {*group.here, *(pid for procs in self.replacements for pid in procs.here)}
        # of the procs that died here; live ones keep theirs
        remove_files_of(pid for pid in allocation.pids if pid in here)
        return Allocation(allocation.group, allocation.owner, started.procs, slots,
                          allocation.hosts, per_host, replacement=True, pids=started.pids,
                          timeshared=allocation.timeshared)

    async def release(self, name: str, grace_s: float) -> Group:
        """Stop the group's procs and give its GPUs back; returns what it was. The group
        is forgotten only once its procs are stopped: a release cancelled midway (a
        shutdown cancelling a failed restart's) leaves it for the next release to stop."""
        group = self.get(name)
        await stop_procs(group.slot_procs(), grace_s)
        if self.groups.pop(name, None) is not None:  # not released meanwhile
            self.inventory.release(name)
        return group

    async def stop_replacements(self, grace_s: float) -> None:
        """Stop every replacement proc mesh (at shutdown)."""
        for procs in self.replacements:
            await stop_procs(procs, grace_s)
        self.replacements = []
