"""The ResourceManager: one runtime's hosts, resource groups, arbiters and spawned actors.

    rm = await init(scheduler="processes", hosts=2, gpus_per_host=2)
    alloc = await rm.allocate(ResourceRequest("rl", hosts=2, procs_per_host=2), owner="trainer")
    trainer = await rm.spawn("trainer", Trainer, alloc)           # a TenantActor: registered
    generator = await rm.spawn("generator", Generator,
                               await rm.allocate(ResourceRequest("rl", 2, 2), owner="gen"))
    await rm.wake("generator")     # the trainer sleeps on every slot first, verified

It puts together `groups.Groups` (resource groups and allocations), `switching.Switchboard`
(the per-host arbiters, their tenants, the switch protocol, who is awake) and
`faults.Faults` (which spawned meshes died). Its own job is the life of what it spawns: a
spawn is checked, tracked and registered with the arbiters, or undone whole; a removal
undoes all three. Clients (services) use its methods and hear of switches and faults
through a `Watcher`. Faults are seen early: an always-on `ProcWatch` has each host's
arbiter poll the pids of the procs that run spawns, and a host whose arbiter stops
answering is lost (`lost_hosts`). A group's procs can be replaced whole (`restart_group`,
then `reallocate`). Without GPUs, virtual slots (plain CPU procs) stand in for them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from monarch.actor import Actor

from colocate.arbiter.actor import Preempter, TenantActor
from colocate.arbiter.config import ArbiterConfig
from colocate.arbiter.host import HostStatus
from colocate.arbiter.slot import SlotTraffic
from colocate.arbiter.tenant import TenantInfo
from colocate.calls import call_spec
from colocate.monarch_compat import endpoint_names, mesh_name
from colocate.resources.faults import Faults
from colocate.resources.groups import Allocation, Group, Groups
from colocate.resources.hosts import HostJob
from colocate.resources.lost_hosts import LostHosts
from colocate.resources.packing import Inventory, ResourceError, ResourceRequest
from colocate.resources.proc_watch import ProcWatch
from colocate.resources.procs import rank_of
from colocate.resources.spawning import check_importable, check_started, stop_actors
from colocate.resources.switching import Switchboard
from colocate.resources.watcher import Watcher

F = TypeVar("F", bound=Callable[..., Any])


def documented_by(part: Callable[..., Any]) -> Callable[[F], F]:
    """Give a facade verb the docstring of the part's method it passes to: one text, kept
    where the work is done, and shown by `help(rm.verb)`."""
    def document(verb: F) -> F:
        verb.__doc__ = part.__doc__
        return verb
    return document


class ResourceManager:
    """Owns the hosts, the groups' procs, the arbiters, and the actors spawned on them."""

    def __init__(self, job: HostJob, gpus_per_host: int, virtual: bool,
                 arbiter_config: ArbiterConfig) -> None:
        self.job = job
        self.groups = Groups(job.mesh, Inventory(job.num_hosts, gpus_per_host), virtual)
        self.faults = Faults()
        self.switchboard = Switchboard(arbiter_config, on_lost=self.faults.lost)
        self.proc_watch: ProcWatch | None = None  # started with the arbiters
        self.lost_hosts = LostHosts(job, self.faults)  # hosts whose arbiter stopped answering
        self.watchers: list[Watcher] = []
        # name -> its actor mesh and procs per host, for usage()
        self._tenant_actors: dict[str, tuple[Any, int]] = {}

    @property
    def num_hosts(self) -> int:
        return self.groups.inventory.num_hosts

    @property
    def gpus_per_host(self) -> int:
        return self.groups.inventory.gpus_per_host

    @property
    def arbiter_procs(self) -> Any:
        """The proc mesh that runs the hosts' arbiters, one proc per host (for tools that
        look inside them: bench/switch_parts.py times functions there)."""
        return self.switchboard.arbiter_procs

    def watch(self, watcher: Watcher) -> None:
        """Tell `watcher` of switches, faults and the shutdown from now on (each part
        calls what is its own: see `colocate.resources.watcher`)."""
        self.watchers.append(watcher)
        self.switchboard.watchers.append(watcher)
        self.faults.listeners.append(watcher)

    def unwatch(self, watcher: Watcher) -> None:
        """Stop telling `watcher` (a watcher not watching is left as it is)."""
        for watchers in (self.watchers, self.switchboard.watchers, self.faults.listeners):
            if watcher in watchers:
                watchers.remove(watcher)

    # -- groups and allocations ---------------------------------------------------------

    @documented_by(Groups.reserve)
    async def reserve(self, request: ResourceRequest) -> Group:
        return await self.groups.reserve(request)

    def group(self, name: str) -> Group:
        """The resource group `name` (its placement, procs and pids)."""
        return self.groups.get(name)

    def has_group(self, name: str) -> bool:
        return name in self.groups.groups

    @documented_by(Groups.allocate)
    async def allocate(self, request: ResourceRequest, owner: str) -> Allocation:
        return await self.groups.allocate(request, owner)

    @documented_by(Groups.free)
    def free(self, allocation: Allocation) -> None:
        self.groups.free(allocation)

    @documented_by(Groups.replace)
    async def replace_procs(self, allocation: Allocation) -> Allocation:
        return await self.groups.replace(allocation)

    async def restart_group(self, name: str, grace_s: float = 5.0) -> Group:
        """New procs for every slot of group `name` (same hosts, slots and GPUs), the old
        ones killed. What still runs there is lost: remove your spawns first (`remove(...,
        stop=False)`); spawns left on the old procs are failed (their watchers hear it)
        and forgotten. The owners keep their slots: `reallocate` gives each allocation's
        cells on the new procs, so owners that shared a process share one again."""
        self.lost_hosts.check(self.groups.get(name).placement.hosts, f"group {name!r}")
        left = self.faults.on_procs(self.groups.get(name).host_pids())
        self.faults.lost(left, f"its resource group {name!r} was restarted")
        for spawn in left:
            await self.switchboard.unregister(spawn)
            self._forget(spawn)
        self._watch_procs()
        group, _ = await self.groups.restart(name, grace_s)
        return group

    def reallocate(self, allocation: Allocation) -> Allocation:
        """The cells of `allocation` on its group's procs now (after `restart_group`)."""
        return self.groups.reslice(allocation)

    def _give_back(self, allocation: Allocation) -> None:
        """`free` an allocation of the group's own procs; one on replacement procs stands
        for slots its owner still holds through its first allocation, so those stay."""
        if not allocation.replacement:
            self.groups.free(allocation)

    # -- spawned actors --------------------------------------------------------------

    async def spawn(self, name: str, actor_class: type[Actor], allocation: Allocation,
                    *args: Any, **kwargs: Any) -> Any:
        """Spawn `actor_class` on the allocation's procs. A `TenantActor` on time-shared procs
        is registered with its hosts' arbiters (and put to sleep where another tenant is
        awake); on procs of a group without GPUs it takes no slot and never sleeps.

        An actor that cannot start (its class does not import in the procs, a tenant's
        `__init__` raises, its process dies) raises one `SpawnError` naming it and the
        original exception; what the spawn made is undone (its actors stopped, the name
        free again, the allocation given back), and the arbiters and the other tenants go
        on. A tenant is asked from here whether it started before any arbiter calls it."""
        self.faults.reserve(name)
        try:
            await check_importable(allocation.procs, name, actor_class,
                                   list(allocation.slots), allocation.group)
        except BaseException:
            self._forget(name)
            self._give_back(allocation)
            raise
        actors = allocation.procs.spawn(name, actor_class, *args, **kwargs)
        preempters = None
        try:
            tenant = issubclass(actor_class, TenantActor)
            if tenant:  # it checks its own start, time-shared or not
                await check_started(actors, name, actor_class, list(allocation.slots),
                                    allocation.group)
            self.faults.track(name, await mesh_name(actors), allocation.host_pids())
            self._watch_procs()
            if tenant and allocation.timeshared:
                if _preemptible(actor_class):  # see colocate.arbiter.preempt
                    preempters = allocation.procs.spawn(f"{name}_preempt", Preempter)
                await self.switchboard.register(name, actors, allocation, preempters)
                self._tenant_actors[name] = (actors, allocation.procs_per_host)
        except BaseException:
            if preempters is not None:
                await stop_actors(f"{name}_preempt", preempters, 5.0)
            await self._undo_spawn(name, actors, allocation)
            raise
        return actors

    async def _undo_spawn(self, name: str, actors: Any, allocation: Allocation,
                          grace_s: float = 5.0) -> None:
        """Forget a spawn that failed: its tenancy, its name, its actors, its allocation.
        Faults its mesh reports later are ignored (its mesh is no longer tracked)."""
        self._forget(name)
        self._watch_procs()
        await stop_actors(name, actors, grace_s)
        self._give_back(allocation)

    async def remove(self, name: str, actors: Any, grace_s: float = 5.0,
                     stop: bool = True) -> None:
        """Stop spawned actors (unless they died, or `stop` is False: their procs are about
        to be stopped) and forget them; their procs stay. A stop that does not end within
        `grace_s` (its proc died unseen) is left behind."""
        preempters = self.switchboard.preempters.actors.get(name)
        await self.switchboard.unregister(name)
        failed = self.faults.has_failed(name)
        self._forget(name)
        self._watch_procs()
        if stop and not failed:
            if preempters is not None:
                await stop_actors(f"{name}_preempt", preempters, grace_s)
            await stop_actors(name, actors, grace_s)

    def _forget(self, name: str) -> None:
        """Forget spawn `name` here, the one place that does: its tenancy in the view, its
        actors, its faults (the arbiters' side is `Switchboard.unregister`'s)."""
        self.switchboard.forget(name)
        self._tenant_actors.pop(name, None)
        self.faults.forget(name)

    def _watch_procs(self) -> None:
        """Have the arbiters watch the procs that run spawns now."""
        if self.proc_watch is not None:
            self.proc_watch.watch(self.faults.watched())

    async def start(self) -> None:
        """Start the hosts' arbiters, then their watch on the procs."""
        await self.switchboard.start(self.job.mesh, self.gpus_per_host)
        self.proc_watch = ProcWatch(self.switchboard.arbiter, self.job.num_hosts,
                                    self._procs_died, self.lost_hosts.add, self.job.answers)
        self.proc_watch.start()

    def _procs_died(self, host: int, pids: list[int]) -> None:
        """The proc watch of `host` found `pids` dead: their spawns failed."""
        self.faults.died(host, pids, "its proc, pid {pid}, died (found by the proc watch "
                                     f"of host {host})")

    # -- switches ----------------------------------------------------------------------

    async def wake(self, name: str, stages: list[str] | None = None,
                   preempt: bool = False) -> None:
        """Make `name` awake on all its slots, with `stages` (default: all); its hosts
        switch in parallel.

        Every switch goes through this manager, which keeps the arbiters' view after it: a
        tenant with those stages awake since then, alive, with no switch in flight that may
        put them to sleep (and, under a policy that measures, the last one woken on its
        slots), is left as it is without a call.

        With `preempt`, the `@preemptible` calls running in the tenants this wake may put
        to sleep are asked to return what they have (a partial result, typed as such by
        the endpoint) instead of being waited for; other calls drain as ever. A tenant that
        does not honour it within `ArbiterConfig.preempt_timeout_s` fails the wake
        (`PreemptTimeoutError`, naming it) before anything moved."""
        if self.switchboard.is_tenant(name) and self.faults.alive(name) \
                and self.switchboard.awake_now(name, stages) and self.switchboard.holds(name):
            return
        await self.switchboard.wake(name, stages, preempt)

    async def wake_for(self, name: str, stages: Sequence[str] | None,
                       preempt: bool = False) -> None:
        """Wake what a call that needs `stages` (None: every stage) needs of `name`: those
        of its own stages (see `routable`); nothing when it has none of them."""
        if stages is not None and self.switchboard.is_tenant(name):
            stages = self.switchboard.needed(name, stages)
            if not stages:
                return
        await self.wake(name, None if stages is None else list(stages), preempt)

    async def kill_procs(self, allocation: Allocation) -> None:
        """SIGKILL an allocation's procs (a hung replica's); the proc watch reports them."""
        await self.switchboard.kill(list(allocation.host_pids()))

    @documented_by(Switchboard.make_room)
    async def make_room(self, name: str, asked_bytes: int) -> None:
        await self.switchboard.make_room(name, asked_bytes)

    @documented_by(Switchboard.sleep)
    async def sleep(self, name: str) -> None:
        await self.switchboard.sleep(name)

    async def handoff(self, source: str, target: str, keep: list[str] | None = None,
                      first: list[str] | None = None) -> int:
        """Pass `source`'s weights to `target` on every slot they share (see
        `SlotArbiter.handoff`: under the exclusive policy `source` ends asleep, under a
        budget it stays awake where it fits); returns the bytes copied on all slots."""
        return (await self.switchboard.handoffs(source, [target], keep, first))[target]

    @documented_by(Switchboard.handoffs)
    async def handoffs(self, source: str, targets: Sequence[str]) -> dict[str, int]:
        return await self.switchboard.handoffs(source, targets)

    def routable(self, name: str, stages: Sequence[str] | None = None) -> bool:
        """Alive and, for a tenant, awake on all its slots with no switch in flight that may
        put it to sleep: every stage, or those of `stages` it has (a call's needs; the
        others are ignored). Actors that are not tenants never sleep."""
        if not self.faults.alive(name):
            return False
        return not self.switchboard.is_tenant(name) or self.switchboard.awake_now(
            name, self.switchboard.needed(name, stages))

    @documented_by(Faults.why)
    def failure(self, name: str) -> str | None:
        return self.faults.why(name)

    @documented_by(Switchboard.awake_tenants)
    def awake_tenants(self) -> list[str]:
        return self.switchboard.awake_tenants()

    @documented_by(Switchboard.slots_of)
    def slots_of(self, name: str) -> list[tuple[int, int]]:
        return self.switchboard.slots_of(name)

    @documented_by(Switchboard.status)
    async def status(self) -> dict[int, HostStatus]:
        return await self.switchboard.status()

    @documented_by(Switchboard.traffic)
    async def traffic(self) -> dict[int, dict[int, SlotTraffic]]:
        return await self.switchboard.traffic()

    async def usage(self, timeout_s: float = 10.0
                    ) -> dict[int, dict[int, dict[str, TenantInfo | None]]]:
        """host -> slot -> tenant -> its `TenantInfo` now: `resident_bytes` (held now),
        `tagged_bytes` (held when fully awake), `awake_stages`, pid, device. Each tenant
        answers for itself on each of its procs, from here; a proc that died, or does not
        answer within `timeout_s`, reads None (the tenant's other procs still answer)."""

        async def ask(proc: Any) -> TenantInfo | None:
            try:
                return await asyncio.wait_for(proc.describe.call_one(), timeout_s)
            except Exception:
                return None

        asked = [(name, host, slot, ask(rank_of(actors, rank, per_host)))
                 for name, (actors, per_host) in self._tenant_actors.items()
                 if self.switchboard.is_tenant(name)
                 for rank, (host, slot) in enumerate(self.slots_of(name))]
        answers = await asyncio.gather(*(question for *_, question in asked))
        usage: dict[int, dict[int, dict[str, TenantInfo | None]]] = {}
        for (name, host, slot, _), info in zip(asked, answers, strict=True):
            usage.setdefault(host, {}).setdefault(slot, {})[name] = info
        return usage

    # -- teardown --------------------------------------------------------------------

    async def release(self, group: str, grace_s: float = 5.0) -> None:
        """Stop the group's procs and give its GPUs back; its tenants are forgotten (no
        longer routable, their names free again)."""
        released = await self.groups.release(group, grace_s)
        for name in self.switchboard.forget_slots(released.slots()):
            self._forget(name)
        self._watch_procs()

    async def shutdown(self, grace_s: float = 5.0) -> None:
        """End what is under way, then stop every group, the arbiters and the hosts.

        Switches under way end with `SwitchAbortedError`; the watchers (services) are
        closed: calls waiting for a replica end at once, calls in flight get `grace_s` to
        finish, then end with an error. Procs are stopped gracefully, then by force."""
        self.switchboard.abort()
        if self.proc_watch is not None:
            await self.proc_watch.stop()
        await asyncio.gather(*(watcher.close(grace_s) for watcher in list(self.watchers)))
        for group in list(self.groups.groups):
            await self.release(group, grace_s)
        await self.groups.stop_replacements(grace_s)
        await self.switchboard.stop(grace_s)
        global _current
        if _current is self:
            _current = None
        await asyncio.to_thread(self.job.stop, grace_s)


def _preemptible(actor_class: type) -> bool:
    """Whether any endpoint of `actor_class` is declared `@preemptible`."""
    return any(call_spec(actor_class, e).preemptible for e in endpoint_names(actor_class))


_current: ResourceManager | None = None


def current() -> ResourceManager:
    """The ResourceManager that `init()` started last in this process."""
    if _current is None:
        raise ResourceError("no runtime is running: start one with `await colocate.init(...)`")
    return _current


def make_current(rm: ResourceManager) -> None:
    """Make `rm` the runtime `current()` answers (`init` does, once it started)."""
    global _current
    _current = rm
