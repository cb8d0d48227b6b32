"""The ResourceManager: one runtime's hosts, resource groups, arbiters and spawned actors.

    rm = await init(scheduler="processes", hosts=2, gpus_per_host=2)
    alloc = await rm.allocate(ResourceRequest("rl", hosts=2, procs_per_host=2), owner="trainer")
    trainer = await rm.spawn("trainer", Trainer, alloc)           # a TenantActor: registered
    generator = await rm.spawn("generator", Generator,
                               await rm.allocate(ResourceRequest("rl", 2, 2), owner="gen"))
    await rm.wake("generator")     # the trainer sleeps on every slot first, verified

The manager puts together the parts, each with one job: `groups.Groups` (resource groups
and allocations: which procs each owner gets), `spawning.Spawns` (the life of what it
spawns: checked, tracked and registered with the arbiters, or undone whole; a removal
undoes all three), `switching.Switchboard` (the per-host arbiters and the switch
protocol), its `hosts_view.HostsView` (the tenants registered and who is awake),
`handoff_client.Handoffs` (passing weights between tenants, staged or in place) and
`faults.Faults` (which spawned actor meshes died). Its own job is the runtime's face:
clients (services) use its methods, and hear of switches and faults through a
`Listener`; whether a tenant is ready for a call is decided here, once. Faults are seen
early: an always-on proc watch (`ProcWatchClient`) has each host's arbiter poll the pids
of the procs that run spawns, and a host whose arbiter stops answering is lost
(`lost_hosts`). A group's procs can be replaced whole (`restart_group`,
then `reallocate`), for clients that restart a group.
Without GPUs, `gpus_per_host` virtual slots (plain CPU procs) stand in for them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

from monarch.actor import Actor

from colocate import shm_files
from colocate.arbiter.config import ArbiterConfig
from colocate.arbiter.host import HostStatus
from colocate.arbiter.proc_watch import ProcWatchClient
from colocate.arbiter.slot import SlotTraffic
from colocate.arbiter.tenant import TenantInfo
from colocate.resources import zygote
from colocate.resources.faults import Faults
from colocate.resources.groups import Allocation, Group, Groups
from colocate.resources.handoff_client import Handoffs
from colocate.resources.hosts import HostJob
from colocate.resources.hosts_view import HostsView
from colocate.resources.in_place import InPlaceCopier
from colocate.resources.listener import Listener
from colocate.resources.lost_hosts import LostHosts
from colocate.resources.packing import Inventory, ResourceError, ResourceRequest
from colocate.resources.proc_main import HOST
from colocate.resources.procs import ended
from colocate.resources.spawning import Spawns
from colocate.resources.switching import Switchboard

F = TypeVar("F", bound=Callable[..., Any])


def documented_by(part: Callable[..., Any]) -> Callable[[F], F]:
    """Give a facade verb the docstring of the part's method it passes to: one text, kept
    where the work is done, and shown by `help(rm.verb)`."""
    def document(verb: F) -> F:
        verb.__doc__ = part.__doc__
        return verb
    return document


def fork_server(job: HostJob, virtual: bool) -> str | None:
    """Where this runtime's procs are forked from (`zygote`), when its hosts have no GPUs
    and COLOCATE_FORK_PROCS is not "0": on this machine (the "local" and "processes"
    hosts), this process's fork server; on hosts whose worker is colocate's
    (`colocate.resources.worker`: Slurm, torchx), the fork server each host's worker
    started; elsewhere (a Monarch job's own workers) nowhere: each proc starts on its own."""
    if not virtual or not zygote.wanted():
        return None
    return zygote.address() if job.scheduler in ("local", "processes") else HOST


class ResourceManager:
    """Owns the hosts, the groups' procs, the arbiters, and the actors spawned on them."""

    def __init__(self, job: HostJob, gpus_per_host: int, virtual: bool,
                 arbiter_config: ArbiterConfig) -> None:
        self.job = job
        self.fork_server = fork_server(job, virtual)
        self.groups = Groups(job.mesh, Inventory(job.num_hosts, gpus_per_host), virtual,
                             self.fork_server)
        self.faults = Faults()
        self.switchboard = Switchboard(arbiter_config, on_lost=self.faults.lost)
        self.view: HostsView = self.switchboard.view
        self._handoffs = Handoffs(self.view, self.switchboard, InPlaceCopier(
            self.view, self.switchboard, arbiter_config))
        self.spawns = Spawns(self.groups, self.faults, self.switchboard)
        self.lost_hosts = LostHosts(job, self.faults)  # hosts whose arbiter stopped answering
        self.listeners: list[Listener] = []

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

    def listen(self, listener: Listener) -> None:
        """Tell `listener` of switches, faults and the shutdown from now on (each part
        calls what is its own: see `colocate.resources.listener`)."""
        self.listeners.append(listener)
        self.switchboard.listeners.append(listener)
        self.faults.listeners.append(listener)

    def unlisten(self, listener: Listener) -> None:
        """Stop telling `listener` (one not listening is left as it is)."""
        for listeners in (self.listeners, self.switchboard.listeners, self.faults.listeners):
            if listener in listeners:
                listeners.remove(listener)

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
        stop=False)`); spawns left on the old procs are failed (their listeners hear it)
        and forgotten. The owners keep their slots: `reallocate` gives each allocation's
        cells on the new procs, so owners that shared a process share one again."""
        self.lost_hosts.check(self.groups.get(name).placement.hosts, f"group {name!r}")
        await self.spawns.lose(self.faults.on_procs(self.groups.get(name).host_pids()),
                               f"its resource group {name!r} was restarted")
        group, _ = await self.groups.restart(name, grace_s)
        return group

    def reallocate(self, allocation: Allocation) -> Allocation:
        """The cells of `allocation` on its group's procs now (after `restart_group`)."""
        return self.groups.reslice(allocation)

    # -- spawned actors --------------------------------------------------------------

    @documented_by(Spawns.spawn)
    async def spawn(self, name: str, actor_class: type[Actor], allocation: Allocation,
                    *args: Any, **kwargs: Any) -> Any:
        return await self.spawns.spawn(name, actor_class, allocation, *args, **kwargs)

    @documented_by(Spawns.remove)
    async def remove(self, name: str, actors: Any, grace_s: float = 5.0,
                     stop: bool = True) -> None:
        await self.spawns.remove(name, actors, grace_s, stop)

    @property
    def proc_watch(self) -> ProcWatchClient | None:
        """The always-on watch of the procs that run spawns (None before `start`)."""
        return self.spawns.proc_watch

    async def start(self) -> None:
        """Start the hosts' arbiters, then their watch on the procs."""
        await self.switchboard.start(self.job.mesh, self.gpus_per_host, self.fork_server)
        self.spawns.start_proc_watch(self.job.num_hosts, self.lost_hosts.add, self.job.answers)

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
        if self.view.is_tenant(name) and self.view.holds(name) and self._ready(name, stages):
            return
        await self.switchboard.wake(name, stages, preempt)

    async def wake_for(self, name: str, stages: Sequence[str] | None,
                       preempt: bool = False) -> None:
        """Wake what a call that needs `stages` (None: every stage) needs of `name`: those
        of its own stages (see `routable`); nothing when it has none of them."""
        if stages is not None and self.view.is_tenant(name):
            stages = self.view.needed(name, stages)
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
        return (await self._handoffs.handoffs(source, [target], keep, first))[target]

    @documented_by(Handoffs.handoffs)
    async def handoffs(self, source: str, targets: Sequence[str]) -> dict[str, int]:
        return await self._handoffs.handoffs(source, targets)

    def routable(self, name: str, stages: Sequence[str] | None = None) -> bool:
        """Ready for a call that needs `stages` (None: every stage; those it lacks are
        ignored): see `_ready`."""
        return self._ready(name, self.view.needed(name, stages))

    def _ready(self, name: str, stages: Collection[str] | None) -> bool:
        """Whether `name` is awake enough: alive and, for a tenant, `stages` (None: all
        of its own) awake on all its slots with no switch in flight that may put them to
        sleep. Actors that are not tenants never sleep. A call routes to a ready replica,
        and a wake of a ready tenant that holds its slots' working memory is skipped."""
        return self.faults.alive(name) and (not self.view.is_tenant(name)
                                            or self.view.awake_now(name, stages))

    @documented_by(HostsView.roomy_for)
    def roomy_for(self, name: str) -> bool:
        return self.view.roomy_for(name)

    @documented_by(Faults.why)
    def failure(self, name: str) -> str | None:
        return self.faults.why(name)

    @documented_by(HostsView.awake_tenants)
    def awake_tenants(self) -> list[str]:
        return self.view.awake_tenants()

    @documented_by(HostsView.slots_of)
    def slots_of(self, name: str) -> list[tuple[int, int]]:
        return self.view.slots_of(name)

    @documented_by(Switchboard.status)
    async def status(self) -> dict[int, HostStatus]:
        return await self.switchboard.status()

    @documented_by(Switchboard.traffic)
    async def traffic(self) -> dict[int, dict[int, SlotTraffic]]:
        return await self.switchboard.traffic()

    @documented_by(Switchboard.host_memory)
    async def host_memory(self) -> dict[int, dict[str, int | str | None]]:
        return await self.switchboard.host_memory()

    @documented_by(Spawns.usage)
    async def usage(self, timeout_s: float = 10.0
                    ) -> dict[int, dict[int, dict[str, TenantInfo | None]]]:
        return await self.spawns.usage(timeout_s)

    # -- teardown --------------------------------------------------------------------

    async def release(self, group: str, grace_s: float = 5.0) -> None:
        """Stop the group's procs and give its GPUs back; its tenants are forgotten (no
        longer routable, their names free again)."""
        released = await self.groups.release(group, grace_s)
        self.spawns.forget_on(released.slots())

    async def shutdown(self, grace_s: float = 5.0) -> None:
        """End what is under way, then stop every group, the arbiters and the hosts.

        Switches under way end with `SwitchAbortedError`; the listeners (services) are
        closed: calls waiting for a replica end at once, calls in flight get `grace_s` to
        finish, then end with an error. Procs are stopped gracefully, then by force."""
        self.switchboard.abort()
        if self.proc_watch is not None:
            await self.proc_watch.stop()
        await asyncio.gather(*(listener.close(grace_s) for listener in list(self.listeners)))
        for group in list(self.groups.groups):
            await self.release(group, grace_s)
        await self.groups.stop_replacements(grace_s)
        await self.switchboard.stop(grace_s)
        global _current
        if _current is self:
            _current = None
        await asyncio.to_thread(self.job.stop, grace_s)
        # procs of a lost host may outlive their stop and end with their host's job
        await ended(shm_files.pending(), grace_s)
        shm_files.remove_files_of(())


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
