"""The ResourceManager: hosts, resource groups on shared procs, and the per-host arbiters.

    rm = await init(scheduler="processes", hosts=2, gpus_per_host=2)
    alloc = await rm.allocate(ResourceRequest("rl", hosts=2, procs_per_host=2), owner="trainer")
    trainer = await rm.spawn("trainer", Trainer, alloc)           # a TenantActor: registered
    generator = await rm.spawn("generator", Generator,
                               await rm.allocate(ResourceRequest("rl", 2, 2), owner="gen"))
    await rm.wake("generator")     # the trainer sleeps on every slot first, verified

A resource group is placed once (first-fit GPUs, `packing`) and gets one Monarch proc per
GPU, its CUDA_VISIBLE_DEVICES set at bootstrap, before CUDA starts. Every allocation in
the group is a slice of those procs, so the services of a group share processes, CUDA
contexts and torch_memory_saver. Each host runs one `Arbiter` on a proc of its own.
Without GPUs, `gpus_per_host` virtual slots (plain CPU procs) stand in for them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import monarch.actor
from monarch.actor import Actor, default_bootstrap_cmd, endpoint

from colocate.arbiter.actor import Arbiter, HostStatus, TenantActor, remote_errors
from colocate.arbiter.core import ArbiterConfig
from colocate.arbiter.errors import ArbiterError
from colocate.arbiter.tenant import TenantInfo
from colocate.monarch_compat import BootstrapCommand
from colocate.resources.hosts import HostJob, start_hosts
from colocate.resources.hosts import gpus_per_host as detect_gpus
from colocate.resources.packing import Inventory, Placement, ResourceError, ResourceRequest
from colocate.resources.spawning import check_importable, check_started

logger = logging.getLogger(__name__)

SLOT_ENV = "COLOCATE_SLOT"


def select(mesh: Any, **ranges: int | slice) -> Any:
    """`mesh.slice(**ranges)`, skipping dims the mesh does not have (this_host() has no
    "hosts" dim: its one host is always index 0)."""
    present = {dim: r for dim, r in ranges.items() if dim in mesh.extent.labels}
    return mesh.slice(**present) if present else mesh


def _slot_env(slot: int, virtual: bool) -> dict[str, str]:
    """A slot proc's environment: its slot, and on a real GPU the slot to resolve to a GPU
    UUID when the proc starts (`hosts.run_on_slot_gpu`), plus torch_memory_saver's preload
    environment when this process runs in preload mode (`COLOCATE_TMS_HOOK_MODE=preload`):
    the hook must be in LD_PRELOAD before the proc starts. Its paths are this process's,
    as the bootstrap's Python is (hosts run the same installation)."""
    from colocate.memory.cuda import HOOK_MODE_ENV
    from colocate.resources.hosts import GPU_SLOT_ENV

    if virtual:
        return {SLOT_ENV: str(slot)}
    env = {SLOT_ENV: str(slot), GPU_SLOT_ENV: str(slot)}
    if os.environ.get(HOOK_MODE_ENV) == "preload":
        from colocate.memory import preload_env

        preload = preload_env()
        env.update({key: preload[key] for key in ("LD_PRELOAD", "LD_LIBRARY_PATH",
                                                  HOOK_MODE_ENV) if key in preload})
    return env


def _bootstrap(env: Callable[[dict[str, int]], dict[str, str]]) -> Callable[[Any], Any]:
    """A bootstrap command for each proc with `env(its coordinates)` added, set before the
    proc starts. A GPU slot's proc (`GPU_SLOT_ENV` in its env) first runs
    `hosts.run_on_slot_gpu`, which sets CUDA_VISIBLE_DEVICES to its GPU's UUID on the proc's
    own host, then Monarch's bootstrap module, so CUDA sees only that GPU."""
    from colocate.resources.hosts import GPU_SLOT_ENV

    def command(point: Any) -> BootstrapCommand:
        base = default_bootstrap_cmd()
        extra = env(dict(point))
        args = list(base.args)
        if GPU_SLOT_ENV in extra:
            if args[:1] != ["-m"] or len(args) < 2:
                raise ResourceError(
                    f"cannot give a GPU slot's proc its GPU: Monarch's bootstrap command is "
                    f"{base.program} {args}, not `python -m <module>`")
            args = ["-c", "from colocate.resources.hosts import run_on_slot_gpu; "
                    f"run_on_slot_gpu({args[1]!r})", *args[2:]]
        return BootstrapCommand(base.program, base.arg0, args, {**(base.env or {}), **extra})

    return command


class ProcProbe(Actor):
    """Tells what a proc is: its pid and the slot environment it was started with."""

    @endpoint
    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "slot": os.environ.get(SLOT_ENV),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


@dataclass(frozen=True)
class Allocation:
    """Procs of a resource group given to one owner (a service replica, a tenant).

    `slots` lists (host, slot) per proc in mesh order; `procs` is the Monarch proc mesh
    slice with dims (hosts, gpus).
    """

    group: str
    owner: str
    procs: Any
    slots: tuple[tuple[int, int], ...]
    hosts: int
    procs_per_host: int


@dataclass
class Group:
    placement: Placement
    procs: Any  # ProcMesh with dims (hosts, gpus)
    pids: list[int]
    used: dict[str, set[tuple[int, int]]] = field(default_factory=dict)  # owner -> (h, g)

    def slot(self, host: int, proc: int) -> tuple[int, int]:
        """The (host, slot) of the group's proc at local coordinates (host, proc)."""
        gpus = self.placement.gpus[host]
        return self.placement.hosts[host], gpus[proc] if gpus else proc


class ResourceManager:
    """Owns the hosts, the groups' procs, the arbiters, and the tenants registered on them."""

    def __init__(self, job: HostJob, gpus_per_host: int, virtual: bool,
                 arbiter_config: ArbiterConfig) -> None:
        self.job = job
        self.virtual = virtual
        self.inventory = Inventory(job.num_hosts, gpus_per_host)
        self.groups: dict[str, Group] = {}
        self.tenants: dict[str, list[tuple[int, int]]] = {}  # name -> (host, slot)
        self.stages: dict[str, tuple[str, ...]] = {}  # name -> its stages
        self.awake: dict[str, bool] = {}  # name -> fully awake on all its slots (last view)
        self.host_status: dict[int, HostStatus] = {}  # the arbiters' answers, last view
        self.drainers: list[Callable[[set[str]], Awaitable[None]]] = []
        self._switching: Counter[str] = Counter()
        self.spawned: set[str] = set()  # every actor mesh name spawned, tenant or not
        self.failed: set[str] = set()  # spawned meshes whose actors died
        self.failure_listeners: list[Callable[[str, str], None]] = []
        self.extra_procs: list[tuple[Any, list[int]]] = []  # replacement procs, their pids
        self._abandoned: set[str] = set()  # full mesh names of spawns that failed
        self._tenant_actors: dict[str, Any] = {}  # name -> its actor mesh, for usage()
        self.arbiter_config = arbiter_config
        self._arbiter_procs: Any = None
        self.arbiters: Any = None

    def on_fault(self, failure: Any) -> None:
        """Monarch's unhandled-fault hook: a mesh failed (a proc died, an actor crashed).

        The tenant it belongs to is marked failed and listeners (services) are told; the
        fault counts as handled, so the client goes on. Runs on Monarch's thread: listeners
        must only record and schedule."""
        mesh = getattr(failure, "mesh_name", "")
        tenant = mesh.rsplit("-", 1)[0]
        logger.warning("mesh failure: %s", str(failure).splitlines()[0])
        if mesh in self._abandoned:  # a failed spawn's actors, already undone
            return
        if tenant in self.spawned and tenant not in self.failed:
            self.failed.add(tenant)
            for listener in self.failure_listeners:
                listener(tenant, str(failure))

    async def _start_arbiters(self) -> None:
        self._arbiter_procs = self.job.mesh.spawn_procs(per_host={"procs": 1})
        slots = list(range(self.inventory.gpus_per_host))
        self.arbiters = self._arbiter_procs.spawn("arbiter", Arbiter, slots,
                                                  self.arbiter_config)
        await self.arbiters.status.call()

    def arbiter(self, host: int) -> Any:
        return select(self.arbiters, hosts=host)

    # -- groups and allocations ---------------------------------------------------------

    async def reserve(self, request: ResourceRequest) -> Group:
        """Place the group and start its procs: one per GPU (or virtual slot)."""
        placement = self.inventory.place(request)
        try:
            procs = self._spawn_group_procs(placement)
            info = await procs.spawn("probe", ProcProbe).info.call()
        except BaseException:
            self.inventory.release(request.resource_group)
            raise
        group = Group(placement, procs, [value["pid"] for _, value in info.items()])
        self.groups[request.resource_group] = group
        logger.info("resource group %r on hosts %s, gpus %s", request.resource_group,
                    placement.hosts, placement.gpus)
        return group

    def _spawn_group_procs(self, placement: Placement) -> Any:
        first, count = placement.hosts[0], len(placement.hosts)
        hosts = select(self.job.mesh, hosts=slice(first, first + count))
        virtual = self.virtual or not placement.with_gpus

        def env(point: dict[str, int]) -> dict[str, str]:
            gpus = placement.gpus[point.get("hosts", 0)]
            return _slot_env(gpus[point["gpus"]] if gpus else point["gpus"], virtual)

        return hosts.spawn_procs(per_host={"gpus": placement.procs_per_host},
                                 bootstrap_command=_bootstrap(env))

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
                return Allocation(request.resource_group, owner, procs, slots,
                                  request.hosts, request.procs_per_host)
        raise ResourceError(
            f"{owner!r} already uses every proc of resource group {request.resource_group!r} "
            f"that a {request.hosts} x {request.procs_per_host} slice could take; release one "
            "of its allocations or reserve a larger group.")

    def free(self, allocation: Allocation) -> None:
        """Give an allocation's procs back to its owner's pool (the group keeps them)."""
        group = self.groups[allocation.group]
        cells = {(h, p) for h in range(len(group.placement.hosts))
                 for p in range(group.placement.procs_per_host)
                 if group.slot(h, p) in allocation.slots}
        group.used.get(allocation.owner, set()).difference_update(cells)

    # -- tenants ---------------------------------------------------------------------

    async def spawn(self, name: str, actor_class: type[Actor], allocation: Allocation,
                    *args: Any, **kwargs: Any) -> Any:
        """Spawn `actor_class` on the allocation's procs. A `TenantActor` is registered with
        its hosts' arbiters (and put to sleep where another tenant is awake).

        An actor that cannot start (its class does not import in the procs, a tenant's
        `__init__` raises, its process dies) raises one `SpawnError` naming it and the
        original exception; what the spawn made is undone (its actors stopped, the name
        free again, the allocation given back), and the arbiters and the other tenants go
        on. A tenant is asked from here whether it started before any arbiter calls it."""
        if name in self.spawned:
            raise ArbiterError(f"actors named {name!r} already exist; names are unique")
        try:
            await check_importable(allocation.procs, name, actor_class,
                                   list(allocation.slots), allocation.group)
        except BaseException:
            self._give_back(allocation)
            raise
        actors = allocation.procs.spawn(name, actor_class, *args, **kwargs)
        self.spawned.add(name)
        try:
            if issubclass(actor_class, TenantActor):
                await check_started(actors, name, actor_class, list(allocation.slots),
                                    allocation.group)
                await self._register(name, actors, allocation)
        except BaseException:
            await self._undo_spawn(name, actors, allocation)
            raise
        return actors

    async def _register(self, name: str, actors: Any, allocation: Allocation) -> None:
        """Register a started tenant with the arbiters of its slots (on all or on none)."""
        self.tenants[name] = list(allocation.slots)
        per_host = allocation.procs_per_host
        try:
            async with remote_errors():
                infos = await asyncio.gather(*(
                    self.arbiter(host).register.call_one(
                        slot, name, select(actors, hosts=i // per_host, gpus=i % per_host))
                    for i, (host, slot) in enumerate(allocation.slots)))
        except BaseException:  # registered nowhere, or everywhere it was undone
            await asyncio.gather(*(self.arbiter(host).unregister.call_one(name, [slot])
                                   for host, slot in allocation.slots), return_exceptions=True)
            raise
        self.stages[name] = infos[0].stages
        self._tenant_actors[name] = actors
        await self._refresh()

    async def _undo_spawn(self, name: str, actors: Any, allocation: Allocation,
                          grace_s: float = 5.0) -> None:
        """Forget a spawn that failed: its tables, its name, its actors, its allocation.
        Faults its mesh reports later are ignored (`on_fault`)."""
        for table in (self.tenants, self.stages, self.awake, self._tenant_actors):
            table.pop(name, None)
        try:  # Monarch's full mesh name (name-<id>), which its late faults carry
            self._abandoned.add(await asyncio.wait_for(actors._name, grace_s))
        except Exception:
            pass
        self.spawned.discard(name)
        self.failed.discard(name)
        await self._stop_actors(name, actors, grace_s)
        self._give_back(allocation)

    def _give_back(self, allocation: Allocation) -> None:
        """`free` an allocation of the group's own procs; one on replacement procs
        (`replace_procs`) stands for slots its owner still holds, so it stays."""
        if allocation.group in self.groups and not any(
                allocation.procs is procs for procs, _ in self.extra_procs):
            self.free(allocation)

    async def remove(self, name: str, actors: Any, grace_s: float = 5.0) -> None:
        """Stop spawned actors (unless they died) and forget them; their procs stay. A
        stop that does not end within `grace_s` (its proc died unseen) is left behind."""
        if name in self.tenants:
            async with remote_errors():
                await asyncio.gather(*(self.arbiter(h).unregister.call_one(name, slots)
                                       for h, slots in self._by_host(name).items()))
        for table in (self.tenants, self.stages, self.awake, self._tenant_actors):
            table.pop(name, None)
        self.spawned.discard(name)
        if name not in self.failed:
            await self._stop_actors(name, actors, grace_s)

    @staticmethod
    async def _stop_actors(name: str, actors: Any, grace_s: float) -> None:
        try:
            await asyncio.wait_for(actors.stop(), grace_s)
        except Exception as err:  # a timeout: Monarch waits 30 s on a dead proc
            logger.warning("the actors of %r did not stop within %s s (%s); left behind",
                           name, grace_s, str(err).splitlines()[0] if str(err) else
                           type(err).__name__)

    def _by_host(self, name: str) -> dict[int, list[int]]:
        if name not in self.tenants:
            raise ArbiterError(f"unknown tenant {name!r}; tenants: {sorted(self.tenants)}")
        by_host: dict[int, list[int]] = {}
        for host, slot in self.tenants[name]:
            by_host.setdefault(host, []).append(slot)
        return by_host

    async def wake(self, name: str, stages: list[str] | None = None) -> None:
        """Make `name` awake on all its slots; its hosts switch in parallel.

        Every switch goes through this manager, which keeps the arbiters' view after it: a
        tenant awake since then, with no switch in flight that may put it to sleep, is left
        as it is without a call."""
        by_host = self._by_host(name)
        if self.routable(name):
            return
        await self._switch(self._neighbours(name), lambda: {
            h: self.arbiter(h).wake.call_one(name, slots, stages) for h, slots in by_host.items()})

    async def sleep(self, name: str) -> None:
        """Put `name` to sleep on all its slots, verified."""
        by_host = self._by_host(name)
        await self._switch({name}, lambda: {
            h: self.arbiter(h).sleep.call_one(name, slots) for h, slots in by_host.items()})

    async def handoff(self, source: str, target: str, keep: list[str] | None = None,
                      first: list[str] | None = None) -> int:
        """Pass `source`'s weights to `target` on every slot they share, staged (see
        `SlotArbiter.handoff`); returns the bytes copied on all slots. Afterwards `target`
        is awake and `source` asleep there."""
        by_host = self._by_host(target)
        self._by_host(source)  # an unknown source fails here
        apart = set(self.tenants[target]) - set(self.tenants[source])
        if apart:
            raise ArbiterError(f"handoff {source} -> {target}: {source} is not on {target}'s "
                               f"(host, slot)s {sorted(apart)}; colocate them in one resource "
                               "group, or sync through shared memory (services.sync_weights)")
        copied = 0

        async def on(host: int, slots: list[int]) -> HostStatus:
            nonlocal copied
            moved, status = await self.arbiter(host).handoff.call_one(
                source, target, slots, keep, first)
            copied += moved
            return status

        await self._switch(self._neighbours(target) | {source},
                           lambda: {h: on(h, slots) for h, slots in by_host.items()})
        return copied

    def _neighbours(self, name: str) -> set[str]:
        """The tenants that share a slot with `name`: a wake of `name` may put them to sleep."""
        mine = set(self.tenants[name])
        return {other for other, slots in self.tenants.items()
                if other != name and mine.intersection(slots)}

    async def _switch(self, touched: set[str],
                      calls: Callable[[], dict[int, Awaitable[HostStatus]]]) -> None:
        """Make arbiter calls (host -> call) that may put `touched` to sleep: first stop
        routing to them and let the drainers (services) finish their in-flight requests;
        after, update `awake` from the hosts' answers (from every host's status, when a call
        failed and left its host's state unknown).

        `calls` makes the calls only when invoked: a Monarch call is sent when it is made,
        not when it is awaited, so making them before the drain would race it."""
        self._switching.update(touched)
        try:
            await asyncio.gather(*(drain(touched) for drain in self.drainers))
            pending = calls()
            try:
                async with remote_errors():
                    answers = await asyncio.gather(*pending.values())
            except BaseException:
                await self._refresh()  # before routing resumes: the old view is stale now
                raise
            self.host_status.update(zip(pending, answers, strict=True))
            self._update_awake()
        finally:
            self._switching.subtract(touched)

    async def _refresh(self) -> None:
        self.host_status = await self.status()
        self._update_awake()

    def _update_awake(self) -> None:
        status = self.host_status
        self.awake = {
            name: all(set(status[h][slot].get(name) or ()) >= set(self.stages.get(name, ()))
                      and bool(status[h][slot].get(name)) for h, slot in slots)
            for name, slots in self.tenants.items()}

    def routable(self, name: str) -> bool:
        """Alive and, for a tenant, fully awake on all its slots with no switch in flight
        that may put it to sleep. Actors that are not tenants never sleep."""
        if name in self.failed or name not in self.spawned:
            return False
        if name not in self.tenants:
            return True
        return self.awake.get(name, False) and self._switching[name] <= 0

    async def replace_procs(self, allocation: Allocation) -> Allocation:
        """New procs for the slots of an allocation whose procs died (same hosts, same
        slots and CUDA_VISIBLE_DEVICES). The group's other procs are left as they are."""
        group = self.groups[allocation.group]
        virtual = self.virtual or not group.placement.with_gpus
        hosts = sorted({h for h, _ in allocation.slots})
        slots = allocation.slots
        per_host = allocation.procs_per_host

        def env(point: dict[str, int]) -> dict[str, str]:
            _, slot = slots[point.get("hosts", 0) * per_host + point["gpus"]]
            return _slot_env(slot, virtual)

        procs = select(self.job.mesh, hosts=slice(hosts[0], hosts[-1] + 1)).spawn_procs(
            per_host={"gpus": per_host}, bootstrap_command=_bootstrap(env))
        info = await procs.spawn("probe", ProcProbe).info.call()
        self.extra_procs.append((procs, [value["pid"] for _, value in info.items()]))
        return Allocation(allocation.group, allocation.owner, procs, slots, allocation.hosts,
                          per_host)

    async def usage(self) -> dict[int, dict[int, dict[str, TenantInfo | None]]]:
        """host -> slot -> tenant -> its `TenantInfo` now: `resident_bytes` (held now),
        `tagged_bytes` (held when fully awake), `awake_stages`, pid, device. Each tenant
        answers for itself, from here; one that failed, or does not answer, is None."""
        names = [n for n in self.tenants if n in self._tenant_actors]

        async def ask(name: str) -> list[TenantInfo | None]:
            if name in self.failed:
                return [None] * len(self.tenants[name])
            try:
                found = await self._tenant_actors[name].describe.call()
            except Exception:
                return [None] * len(self.tenants[name])
            return [info for _, info in found.items()]  # mesh order: the allocation's slots

        answers = await asyncio.gather(*(ask(name) for name in names))
        usage: dict[int, dict[int, dict[str, TenantInfo | None]]] = {}
        for name, infos in zip(names, answers, strict=True):
            for (host, slot), info in zip(self.tenants[name], infos, strict=True):
                usage.setdefault(host, {}).setdefault(slot, {})[name] = info
        return usage

    async def status(self) -> dict[int, HostStatus]:
        """host -> slot -> tenant -> awake stages ([] asleep, None unknown)."""
        found = await self.arbiters.status.call()
        return {point["hosts"] if "hosts" in dict(point) else 0: value
                for point, value in found.items()}

    # -- teardown --------------------------------------------------------------------

    async def release(self, group: str, grace_s: float = 5.0) -> None:
        """Stop the group's procs and give its GPUs back."""
        found = self.groups.pop(group, None)
        if found is None:
            raise ResourceError(f"unknown resource group {group!r}; groups: {sorted(self.groups)}")
        self.tenants = {n: s for n, s in self.tenants.items()
                        if not any((h, sl) in self._group_slots(found) for h, sl in s)}
        await _stop(found.procs, found.pids, grace_s)
        self.inventory.release(group)

    def _group_slots(self, group: Group) -> set[tuple[int, int]]:
        return {group.slot(h, p) for h in range(len(group.placement.hosts))
                for p in range(group.placement.procs_per_host)}

    async def shutdown(self, grace_s: float = 5.0) -> None:
        """Stop every group, the arbiters and the hosts: gracefully, then by force."""
        for group in list(self.groups):
            await self.release(group, grace_s)
        for procs, pids in self.extra_procs:
            await _stop(procs, pids, grace_s)
        self.extra_procs = []
        if self._arbiter_procs is not None:
            await _stop(self._arbiter_procs, [], grace_s)
            self._arbiter_procs = None
        global _current
        if _current is self:
            _current = None
        await asyncio.to_thread(self.job.stop, grace_s)


async def _stop(procs: Any, pids: list[int], grace_s: float) -> None:
    """Stop a proc mesh within `grace_s`, then kill what is left of it on this machine."""
    try:
        await asyncio.wait_for(procs.stop(), grace_s)
    except Exception as err:  # a timeout, or procs that already died
        logger.warning("procs did not stop within %s s (%s); killing %s", grace_s, err, pids)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


_current: ResourceManager | None = None


def current() -> ResourceManager:
    """The ResourceManager that `init()` started last in this process."""
    if _current is None:
        raise ResourceError("no runtime is running: start one with `await colocate.init(...)`")
    return _current


async def init(scheduler: Any = "local", hosts: int = 1, gpus_per_host: int | None = None,
               arbiter: ArbiterConfig | None = None, **options: Any) -> ResourceManager:
    """Start the hosts and their arbiters and return the ResourceManager.

    `gpus_per_host` defaults to the GPUs NVML sees; on a machine without GPUs give it to get
    that many virtual slots (CPU procs).
    """
    found = detect_gpus()
    if gpus_per_host is None:
        if found == 0:
            raise ResourceError("no GPU found on this host: pass gpus_per_host=N to run with N "
                                "virtual GPU slots (CPU procs)")
        gpus_per_host = found
    if found and gpus_per_host > found:
        raise ResourceError(f"gpus_per_host={gpus_per_host}, but this host has {found} GPUs")
    job = await asyncio.to_thread(start_hosts, scheduler, hosts, **options)
    rm = ResourceManager(job, gpus_per_host, virtual=found == 0,
                         arbiter_config=arbiter or ArbiterConfig())
    monarch.actor.unhandled_fault_hook = rm.on_fault
    try:
        await rm._start_arbiters()
    except BaseException:
        job.stop()
        raise
    global _current
    _current = rm
    return rm
