"""Restarting a resource group whole: the services of a group with `restart="group"` come
back together, on one new proc per slot, so tenants that shared a process share one again.

    restarts = group_restarts("rl")               # or svc.restarts, for any of its services
    async def reload(event: RestartEvent) -> None:
        await trainer.replicas[0].actors.load.call(checkpoint)   # direct, or routed: see below
    restarts.on_restart.append(reload)
    restarts.events                               # every restart so far: RestartEvent

A DDP/FSDP trainer cannot lose a rank and go on, and a generator over the trainer's procs
cannot either, so with `ServiceConfig(restart="group")` the unit of recovery is the group.
When a replica of one of its services fails (its proc died, its actor crashed, an arbiter
or the proc watch found it dead), `GroupRestarts.failed`:

1. marks every replica of every service of the group failed (their calls in flight end with
   `ReplicaLostError`) and holds routed calls (they wait, as for a respawn);
2. removes the dead generation's actors (the arbiters forget them) and gives the group new
   procs for all its slots, the old ones killed (`rm.restart_group`);
3. spawns the services again in their spawn order, with their arguments, each replica on
   the same slots as before (a multi-proc replica in a new torch.distributed world);
4. awaits the `on_restart` hooks with a `RestartEvent`: the replicas are up and awake as
   spawned, and calls made from inside a hook (routed, `phase`, `sync_weights`) reach them;
5. lets routed calls through.

One restart at a time: failures while one runs (the other replicas of the dead proc,
Monarch's late reports for the old generation) start none; a failure of the new generation
during the hooks starts the next once this one ends. A restart that fails (a service's
`__init__` raises on the new procs, a hook raises) stops what it started, releases the
group's procs, and leaves the services failed with the cause in their error; its event
records the error. A shutdown cancels a restart under way, leaving nothing started.
The services' own `on_respawn` hooks are for one replica's respawn and do not run here.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from colocate.resources.groups import Allocation
from colocate.resources.manager import ResourceManager, current
from services.config import ServiceConfig, ServiceConfigError
from services.holding import running_hooks
from services.replica import Replica, ReplicaState

logger = logging.getLogger(__name__)


class GroupMember(Protocol):
    """What a group restart uses of each of its services (a `services.service.Service`)."""

    name: str
    config: ServiceConfig
    replicas: list[Replica]
    closed: bool

    def hold(self, why: str) -> None: ...

    def end_hold(self, failure: str | None = None, actors_gone: bool = False) -> None: ...

    def track(self, task: asyncio.Task) -> None: ...

    async def start_generation(self, replica: Replica, allocation: Allocation) -> None: ...

    def fail_replica(self, replica: Replica, err: str) -> None: ...


@dataclass(frozen=True)
class RestartEvent:
    """One restart of a resource group, as its hooks and `GroupRestarts.events` see it."""

    group: str
    cause: str  # the first failure: which service and replica, and why
    detected_at: float  # time.time() when the failure reached the service layer
    seconds: float  # from the detection until every service was back (before the hooks)
    count: int  # this group's restarts so far, this one included
    services: tuple[str, ...]  # restarted, in spawn order
    error: str | None = None  # why the restart failed; None when the services came back


Hook = Callable[[RestartEvent], Awaitable[None]]


class GroupRestarts:
    """The services of one resource group in spawn order, its restart hooks, its past
    restarts, and the restart under way (at most one)."""

    def __init__(self, rm: ResourceManager, group: str) -> None:
        self.rm, self.group = rm, group
        self.services: list[GroupMember] = []  # spawn order
        self.policy: str | None = None  # of the services in the group now
        self.on_restart: list[Hook] = []
        self.events: list[RestartEvent] = []
        self.task: asyncio.Task | None = None
        self._again: str | None = None  # a failure of the new generation, during the hooks

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def join(self, service: GroupMember) -> None:
        """Add a service spawned in the group (refused when its policy differs: a group
        restart replaces every proc of the group, so it must know every service there)."""
        policy = service.config.restart
        if self.services and policy != self.policy:
            raise ServiceConfigError(
                f"ServiceConfig: restart={policy!r} for service {service.name!r}, but the "
                f"services of resource group {self.group!r} "
                f"({', '.join(s.name for s in self.services)}) have restart={self.policy!r}; "
                "every service of a group has the same restart policy")
        self.policy = policy
        self.services.append(service)

    def leave(self, service: GroupMember) -> None:
        if service in self.services:
            self.services.remove(service)

    def failed(self, cause: str) -> None:
        """A replica of one of the group's services failed (it is marked so): restart the
        group, unless a restart runs already or the services are shutting down."""
        if self.running:
            self._again = self._again or cause
            return
        services = [s for s in self.services if not s.closed]
        if not services:
            return
        detected, wall = time.monotonic(), time.time()
        logger.warning("resource group %r restarts: %s", self.group, cause)
        for service in services:
            service.hold(f"its resource group {self.group!r} restarts after: {cause}")
        self.task = asyncio.ensure_future(self._restart(services, cause, detected, wall))
        for service in services:  # a shutdown cancels or awaits it
            service.track(self.task)
        self.task.add_done_callback(self._next)

    def _next(self, _: asyncio.Task) -> None:
        again, self._again = self._again, None
        if again is not None and any(r.state is ReplicaState.FAILED for s in self.services
                                     for r in s.replicas):
            self.failed(again)

    async def _restart(self, services: list[GroupMember], cause: str, detected: float,
                       wall: float) -> None:
        started: list[tuple[GroupMember, Replica]] = []  # this restart's new actors
        count = len(self.events) + 1
        names = tuple(s.name for s in services)
        try:
            for service in services:
                for replica in self._recovering(service):
                    await self.rm.remove(replica.tenant, replica.actors, stop=False)
            await self.rm.restart_group(self.group)
            for service in services:
                for replica in self._recovering(service):
                    await service.start_generation(replica,
                                                   self.rm.reallocate(replica.allocation))
                    started.append((service, replica))
            event = RestartEvent(self.group, cause, wall, time.monotonic() - detected, count,
                                 names)
            for _, replica in started:
                replica.move(ReplicaState.HEALTHY)
            with running_hooks(self.group):
                for hook in self.on_restart:
                    await hook(event)
        except BaseException as err:
            await self._undo(services, started, cause, err, wall, detected, count, names)
            if not isinstance(err, Exception):
                raise
            return
        self.events.append(event)
        logger.warning("resource group %r is back after %.2f s (restart %d)", self.group,
                       event.seconds, count)
        for service in services:
            service.end_hold()
        for service, replica in started:  # a new proc that died before it was HEALTHY
            if (why := self.rm.failure(replica.tenant)) is not None:  # the next restart
                service.fail_replica(replica, f"its proc died during the group's restart: "
                                              f"{why}")

    @staticmethod
    def _recovering(service: GroupMember) -> list[Replica]:
        return [r for r in service.replicas if r.state is ReplicaState.RECOVERING]

    async def _undo(self, services: list[GroupMember], started: list[tuple[GroupMember, Replica]],
                    cause: str, err: BaseException, wall: float, detected: float, count: int,
                    names: tuple[str, ...]) -> None:
        """A failed or cancelled restart: stop what it started and leave the services failed
        with why (a shutdown stops the procs itself; a failure releases the group's)."""
        cancelled = not isinstance(err, Exception)
        why = ("the runtime was shut down during the restart" if cancelled else
               f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        if not cancelled:
            logger.error("resource group %r: its restart failed: %s", self.group, why)
            for _, replica in started:
                await self.rm.remove(replica.tenant, replica.actors)
            try:
                await self.rm.release(self.group)
            except Exception as release_err:
                logger.warning("resource group %r: releasing it after a failed restart: %s",
                               self.group, release_err)
            self.events.append(RestartEvent(self.group, cause, wall,
                                            time.monotonic() - detected, count, names, why))
        message = (f"its resource group {self.group!r} did not come back: the restart after "
                   f"({cause}) failed: {why}")
        for service in services:  # actors stopped above, or on the procs killed before
            service.end_hold(message, actors_gone=not cancelled)
        if not cancelled:
            self.services = []  # the group is gone: services spawned in it anew start over


_registries: weakref.WeakKeyDictionary[ResourceManager, dict[str, GroupRestarts]] = \
    weakref.WeakKeyDictionary()


def group_restarts(group: str, rm: ResourceManager | None = None) -> GroupRestarts:
    """Resource group `group`'s restarts (of the runtime `rm`, default the current one):
    its hooks (`on_restart`) and its past restarts (`events`). Hooks may be added before
    the group's services are spawned."""
    rm = rm or current()
    groups = _registries.setdefault(rm, {})
    if group not in groups:
        groups[group] = GroupRestarts(rm, group)
    return groups[group]
