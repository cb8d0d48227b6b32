"""The Service handle: endpoints reached through `route` and `fanout`, awake-only routing,
sessions, bounded retries, and a drained shutdown.

    svc = await spawn_service(ServiceConfig(num_replicas=2, resource_group="rl"), Gen, cfg)
    out = await svc.generate.route(prompt)            # one awake, healthy replica
    outs = await svc.generate.fanout(prompt)          # every awake, healthy replica
    async with svc.session():                         # the routes inside stick to one replica
        await svc.generate.route(prompt)

A call goes to a replica with the stages its endpoint needs awake, or waits for one, as
`config.when_asleep` says (`services.picking`). Every call ends in a result or an exception.

A replica whose proc dies is marked failed and, with `config.respawn`, started again on new
procs for the same slots; calls go to the other replicas meanwhile, or wait for it when it
was the last. `svc.on_respawn` hooks run on the new replica before it takes a call (an RL
loop syncs the trainer's weights into it there, so no call meets stale weights). With
`config.restart="group"`, the whole resource group comes back instead (`services.restart`:
`svc.restarts`); its routed calls are held meanwhile.

Waits (for an awake replica, for calls in flight to finish before a switch) sleep on the
service's `Changes` and wake when something they wait for may have changed: a switch ended
(the resource manager tells its `Listener`), a call finished, a replica changed state.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Generic, TypeVar

from monarch.actor import ActorError

from colocate.calls import call_spec
from colocate.memory import SlotOutOfMemoryError, TagPausedError
from colocate.monarch_compat import endpoint_names
from colocate.resources.groups import Allocation
from colocate.resources.listener import Listener
from colocate.resources.manager import ResourceManager
from colocate.resources.packing import ResourceRequest
from services.autoscaler import Autoscaler, LoadSnapshot, ReplicaLoad
from services.config import ServiceConfig
from services.distributed import setup_distributed
from services.endpoint import ServiceEndpoint, endpoint_error
from services.errors import ReplicaHungError, ServiceClosedError, ServiceUnavailableError
from services.out_of_memory import make_room, refused
from services.picking import Picking
from services.replica import Replica, ReplicaState, ReplicaStateError, tenant_name
from services.restart import GroupRestarts
from services.router import make_router
from services.waiting import Changes

logger = logging.getLogger(__name__)
A = TypeVar("A")  # the actor class of a service's replicas


class Service(Picking, Generic[A]):
    """A set of replicas of one actor class `A`, colocated through the resource manager;
    `svc.<endpoint>` is a `ServiceEndpoint` typed from `A`'s endpoint (services.endpoint).
    It joins `restarts`, its resource group's (refused when its restart policy differs)."""

    def __init__(self, name: str, config: ServiceConfig, actor_class: type[A],
                 rm: ResourceManager, request: ResourceRequest, restarts: GroupRestarts,
                 args: tuple = (), kwargs: dict | None = None) -> None:
        self.name, self.config, self.actor_class, self.rm = name, config, actor_class, rm
        self.request, self.args, self.kwargs = request, args, kwargs or {}
        self.replicas: list[Replica] = []
        self.autoscaler: Autoscaler | None = None  # made by `start`
        self.router = make_router(config.router)  # sessions stick there
        self.endpoints = endpoint_names(actor_class)
        self.needs = {e: call_spec(actor_class, e).stages for e in self.endpoints}  # its stages
        self.bounds = {e: call_spec(actor_class, e).timeout_s for e in self.endpoints}
        self.closed = False
        self.waiting = 0  # calls waiting for a replica
        self._changes = Changes()  # switches, finished calls, replica states, closing
        self.on_respawn: list[Callable[[Replica], Awaitable[None]]] = []
        self._tasks: set[asyncio.Task] = set()  # respawns (or its group's restart) under way
        self.restarts = restarts  # its resource group's
        self.held: str | None = None  # why routed calls wait: its group restarts
        self._loop = asyncio.get_running_loop()
        self._context = contextvars.copy_context()  # the client's Monarch context
        self._listener = Listener(drain=self._drain, changed=self._changes.notify,
                                  failed=self._on_failure, close=self._close_with_runtime)
        restarts.join(self)  # refused when the group's services restart otherwise
        rm.listen(self._listener)

    def __getattr__(self, name: str) -> ServiceEndpoint[..., Any]:
        """`svc.<endpoint>`; typed from `A`'s endpoint by the mypy plugin
        (services.mypy_plugin), untyped without it."""
        endpoints = self.__dict__.get("endpoints")
        if name.startswith("_") or endpoints is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        if name not in endpoints:
            raise endpoint_error(self.name, self.actor_class, endpoints, name)
        return ServiceEndpoint(self.name, name, self._route, self._fanout, self.tenant_names,
                               self.needs[name])

    def tenant_names(self) -> list[str]:
        """The arbiter's names for the replicas: `phase(svc)` wakes them all."""
        return [r.tenant for r in self.replicas if r.state is ReplicaState.HEALTHY]

    # -- routing -------------------------------------------------------------------------

    def load_snapshot(self) -> LoadSnapshot:
        """What the autoscaler reads: the replicas not stopped, how many are ready, and how
        many calls wait for one."""
        live = tuple(ReplicaLoad(r.index, r.in_flight, r.busy_s, r.state is ReplicaState.HEALTHY)
                     for r in self.replicas if r.state is not ReplicaState.STOPPED)
        return LoadSnapshot(live, len(self._routable(self._ready(set()))), self.waiting)

    async def _route(self, endpoint: str, args: tuple, kwargs: dict) -> Any:
        """`endpoint` on one replica (the session's, inside `session`); a replica found
        broken is failed and the call goes to another, at most `max_retries` times."""
        session = self.router.current()
        failed: set[int] = set()
        faults, room_made = 0, False
        while True:
            replica = await self._pick(session, failed, self.needs[endpoint])
            try:
                return await self._call(replica, endpoint, args, kwargs)
            except ServiceClosedError:
                raise
            except ActorError as err:
                if isinstance(err.exception, TagPausedError):
                    continue  # put to sleep under us: not a failure; route again
                if isinstance(err.exception, SlotOutOfMemoryError):  # services.out_of_memory
                    if room_made:
                        raise refused(self.name, replica.tenant, err.exception,
                                      "refused again after room was made") from None
                    room_made = True
                    await make_room(self.rm, self.name, replica.tenant, err.exception)
                    continue
                if not _is_fault(err):
                    raise err.exception from None  # the endpoint's own error: the caller's
                fault: Exception = err
            except Exception as err:  # the replica's proc is gone, or unreachable
                fault = err
            self.fail_replica(replica, fault)
            failed.add(replica.index)
            faults += 1
            if faults > self.config.max_retries:
                first = str(fault).splitlines()[0] if str(fault) else ""
                raise ServiceUnavailableError(
                    f"service {self.name!r}: {endpoint} failed on {faults} replica(s), "
                    f"max_retries={self.config.max_retries}; the last: "
                    f"{type(fault).__name__}: {first}. {self.failures()}") from fault

    async def _fanout(self, endpoint: str, args: tuple, kwargs: dict) -> list[Any]:
        """Every healthy replica with the endpoint's stages awake; when none is, the
        when_asleep policy first."""
        stages = self.needs[endpoint]
        replicas = self._routable(self._ready(set()), stages)
        if not replicas:
            picked = await self._pick(None, set(), stages)
            replicas = self._routable(self._ready(set()), stages) or [picked]
        return list(await asyncio.gather(*(self._call(r, endpoint, args, kwargs)
                                           for r in replicas)))

    async def _call(self, replica: Replica, endpoint: str, args: tuple, kwargs: dict) -> Any:
        """`replica.call`, bounded (the endpoint's `colocate.bounded`, or `call_timeout_s`):
        past the bound the replica counts as hung and its procs are killed."""
        bound = self.bounds[endpoint] or self.config.call_timeout_s
        try:
            return await asyncio.wait_for(replica.call(endpoint, args, kwargs), bound)
        except TimeoutError:
            await self.rm.kill_procs(replica.allocation)
            raise ReplicaHungError(
                f"service {self.name!r} replica {replica.index} ({replica.tenant}) did not "
                f"answer {endpoint} within {bound} s (call_timeout_s): it counts as hung, its "
                "procs were killed, and it comes back as after a crash") from None

    def lose(self, replica: Replica, err: BaseException) -> bool:
        """For callers that reach a replica's actors directly: True when `err` says the
        replica itself is gone (its proc died, its actor crashed), after marking it failed
        (and respawning it); False when the call merely raised, which is the caller's."""
        if isinstance(err, ActorError) and not _is_fault(err):
            return False
        self.fail_replica(replica, err)
        return True

    def fail_replica(self, replica: Replica, err: BaseException | str,
                     tenant: str | None = None) -> None:
        """Mark a healthy (or leaving) replica failed (when `tenant` is given, only while it
        is still that generation); respawn a healthy one when the config says so: the
        replica alone, or with restart="group" its whole group."""
        if replica.state not in (ReplicaState.HEALTHY, ReplicaState.DRAINING):
            return
        if tenant is not None and replica.tenant != tenant:
            return  # a late report on a generation that is gone
        why = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
        logger.warning("service %r replica %d failed: %s", self.name, replica.index, why)
        leaving = replica.state is ReplicaState.DRAINING
        replica.move(ReplicaState.FAILED, why.splitlines()[0] if why else repr(err))
        if self.config.respawn and not self.closed and not leaving:
            if self.config.restart == "group":
                self.restarts.failed(f"service {self.name!r} replica {replica.index} "
                                     f"({replica.tenant}): {replica.failure}")
                return
            replica.move(ReplicaState.RECOVERING)
            self.track(asyncio.ensure_future(self._respawn(replica)))

    def hold(self, why: str) -> None:
        """Its group restarts: every replica counts as failed and recovering (calls in
        flight end with ReplicaLostError), and routed calls wait until `end_hold`."""
        self.held = why
        for replica in self.replicas:
            if replica.state is ReplicaState.HEALTHY:
                replica.move(ReplicaState.FAILED, why)
            if replica.state is ReplicaState.FAILED:
                replica.move(ReplicaState.RECOVERING)
        self._changes.notify()

    def end_hold(self, failure: str | None = None, actors_gone: bool = False) -> None:
        """Its group's restart ended: routed calls go on. When it failed (`failure`), its
        replicas coming back (or back: a restart hook failed) are failed with why, and with
        `actors_gone` (stopped, or on the procs killed) forget their actors."""
        if failure is not None:
            for replica in self.replicas:
                if replica.state in (ReplicaState.HEALTHY, ReplicaState.RECOVERING):
                    replica.move(ReplicaState.FAILED, failure)
                if actors_gone and replica.state is ReplicaState.FAILED:
                    replica.actors = None
        self.held = None
        self._changes.notify()

    def track(self, task: asyncio.Task) -> None:
        """Track `task` (a respawn, or its group's restart) until it ends: a shutdown
        cancels or awaits it."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_failure(self, tenant: str, why: str) -> None:
        """Monarch supervision saw `tenant` fail (called on Monarch's thread)."""
        for replica in self.replicas:
            if replica.tenant == tenant:
                self._loop.call_soon_threadsafe(self.fail_replica, replica, why, tenant,
                                                context=self._context)

    async def _respawn(self, replica: Replica) -> None:
        """Start the (recovering) replica again on new procs for the same slots, as its
        next generation; until then, calls go to the other replicas."""
        try:
            await self.rm.remove(replica.tenant, replica.actors)
            await self.start_generation(replica, await self.rm.replace_procs(replica.allocation))
            for hook in self.on_respawn:
                await hook(replica)
            replica.move(ReplicaState.HEALTHY)
            logger.info("service %r replica %d is back as %s", self.name, replica.index,
                        replica.tenant)
        except BaseException as err:
            if isinstance(err, Exception):
                logger.exception("service %r: respawning replica %d failed", self.name,
                                 replica.index)
            replica.move(ReplicaState.FAILED, f"{replica.failure}; its respawn failed: "
                                   f"{type(err).__name__}: {err}")
            if not isinstance(err, Exception):
                raise

    def session(self, id: str | None = None) -> AbstractAsyncContextManager[str]:
        """`async with svc.session():` the calls routed inside (in this task, and in the
        tasks it starts) stick to one replica while it can take them; another service's
        session leaves them be. Yields the session's id (`router.sessions` keys). With `id`:
        the caller's session, resumed by each block, kept until `svc.router.end(id)`."""
        return self.router.session(self.name, id)

    # -- replicas ----------------------------------------------------------------------

    async def start(self) -> None:
        """Start `config.num_replicas` replicas, then, with min_replicas < max_replicas, an
        autoscaler."""
        for _ in range(self.config.num_replicas):
            await self.add_replica()
        if self.config.min != self.config.max:
            self.autoscaler = Autoscaler(self.name, self.config, self.load_snapshot,
                                         self.add_replica, self._remove_at)
            self.autoscaler.start()

    async def add_replica(self) -> Replica:
        """Allocate procs in the service's resource group and start one more replica (it
        counts as starting meanwhile; one that cannot start is stopped)."""
        allocation = await self.rm.allocate(self.request, owner=self.name)
        replica = Replica(self.name, len(self.replicas), allocation, self._changes)
        self.replicas.append(replica)
        try:
            replica.actors = await self._start_actors(replica.tenant, allocation)
        except BaseException as err:
            self.rm.free(allocation)
            replica.move(ReplicaState.STOPPED, f"could not start: {type(err).__name__}: {err}")
            raise
        replica.move(ReplicaState.HEALTHY)
        return replica

    async def start_generation(self, replica: Replica, allocation: Allocation) -> None:
        """Start a recovering replica's next generation on `allocation` (new procs for its
        slots), by a respawn or its group's restart; it stays recovering."""
        generation = replica.generation + 1
        actors = await self._start_actors(tenant_name(self.name, replica.index, generation),
                                          allocation)
        replica.actors, replica.allocation, replica.generation = actors, allocation, generation

    async def _start_actors(self, tenant: str, allocation: Allocation) -> Any:
        """Spawn the replica's actors; a multi-proc replica first gets its torch.distributed
        environment (RANK, WORLD_SIZE, MASTER_ADDR...), read by the actors' __init__."""
        if len(allocation.slots) > 1:
            await setup_distributed(allocation)
        return await self.rm.spawn(tenant, self.actor_class, allocation, *self.args,
                                   **self.kwargs)

    async def remove_replica(self, replica: Replica, grace_s: float | None = None) -> None:
        """Stop routing to a healthy replica, let its calls finish, then stop it and free
        its procs; a failed one is stopped and freed at once. A removal that was cancelled
        while draining goes on from there."""
        if replica.state not in (ReplicaState.HEALTHY, ReplicaState.DRAINING, ReplicaState.FAILED):
            raise ReplicaStateError(
                f"replica {replica.index} of service {self.name!r} is {replica.state.value}: "
                "only a healthy, draining or failed replica can be removed")
        if replica.state is ReplicaState.HEALTHY:
            replica.move(ReplicaState.DRAINING)
        if replica.state is ReplicaState.DRAINING:
            await self._drain({replica.tenant}, grace_s)
        if replica.actors is not None:  # None: a failed group restart stopped them
            await self.rm.remove(replica.tenant, replica.actors)
        self.rm.free(replica.allocation)
        replica.move(ReplicaState.STOPPED)

    async def _remove_at(self, index: int) -> None:
        """Remove replica `index` (the autoscaler's scale-down)."""
        await self.remove_replica(self.replicas[index])

    # -- switches and shutdown --------------------------------------------------------

    async def _drain(self, tenants: set[str], timeout_s: float | None = None) -> None:
        """Wait until the replicas of `tenants` have no call in flight (the resource manager
        stopped routing to them before calling this), woken as calls finish."""
        timeout = timeout_s or self.config.wait_timeout_s
        if not await self._drained(tenants, timeout):
            logger.warning("service %r: calls still in flight after %s s; switching anyway",
                           self.name, timeout)

    async def _drained(self, tenants: set[str], timeout_s: float) -> bool:
        return await self._changes.wait_for(
            lambda: not any(r.in_flight for r in self.replicas if r.tenant in tenants),
            timeout_s)

    async def _close(self, grace_s: float, finish_respawns: bool) -> None:
        """Take no new calls (the waiting ones end now), stop scaling, let the respawns
        under way finish (or cancel them), give the calls in flight `grace_s` to finish,
        then end those left with `ServiceClosedError`."""
        self.closed = True
        self._changes.notify()  # calls waiting for a replica end now
        if self.autoscaler is not None:
            await self.autoscaler.stop()
        if not finish_respawns:
            for task in self._tasks:
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if not await self._drained({r.tenant for r in self.replicas}, grace_s):
            logger.warning("service %r: calls still in flight after %s s; ending them",
                           self.name, grace_s)
        for replica in self.replicas:
            replica.calls.abort(lambda: ServiceClosedError(
                f"service {self.name!r} was shut down before this call ended; its result is "
                "lost (shutdown waits grace_s for calls in flight)"))

    async def _close_with_runtime(self, grace_s: float) -> None:
        """The runtime is shutting down (it stops the procs next): close, cancelling
        respawns, and count every replica as stopped."""
        await self._close(grace_s, finish_respawns=False)
        for replica in self.replicas:
            if replica.state is ReplicaState.HEALTHY:
                replica.move(ReplicaState.DRAINING)
            if replica.state in (ReplicaState.DRAINING, ReplicaState.FAILED):
                replica.move(ReplicaState.STOPPED, replica.failure)
        self._stop_listening()

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """Take no new calls, let the ones in flight finish (those still running after
        `grace_s` end with `ServiceClosedError`), then stop the replicas' actors and free
        their procs (the resource group keeps its procs for other services)."""
        await self._close(grace_s, finish_respawns=True)
        self.restarts.leave(self)
        for replica in self.replicas:
            if replica.state is not ReplicaState.STOPPED:
                await self.remove_replica(replica, grace_s)
        self._stop_listening()

    def _stop_listening(self) -> None:
        """Take no more news of switches and faults from the resource manager (the service
        is closed)."""
        self.rm.unlisten(self._listener)


def _is_fault(err: ActorError) -> bool:
    """An ActorError that says the replica itself is broken, not that the call raised."""
    return isinstance(err.exception, (SystemExit, KeyboardInterrupt, MemoryError))
