"""The Service handle: endpoints reached through `route` and `fanout`, awake-only routing,
sessions, bounded retries, and a drained shutdown.

    svc = await spawn_service(ServiceConfig(num_replicas=2, resource_group="rl"), Gen, cfg)
    out = await svc.generate.route(prompt)            # one awake, healthy replica
    outs = await svc.generate.fanout(prompt)          # every awake, healthy replica
    async with svc.session() as s:                    # calls stick to one replica
        await svc.generate.route(prompt, session=s)

A replica is awake when its tenant is awake on all its procs, as the arbiter reports; no
call is sent to a replica that a switch in flight may put to sleep (the resource manager
drains them first). When none is awake, `config.when_asleep` decides: wait (bounded),
wake it, or fail with `ServiceAsleepError`. Every call ends in a result or an exception.

A replica whose proc dies is marked failed and, with `config.respawn`, started again on new
procs for the same slots; calls go to the other replicas meanwhile, or wait for it when it
was the last. `svc.on_respawn` hooks run on the new replica before it takes a call (an RL
loop syncs the trainer's weights into it there, so no call meets stale weights).
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from monarch.actor import ActorError

from colocate.memory import TagPausedError
from colocate.monarch_compat import endpoint_names
from colocate.resources.manager import Allocation, ResourceManager
from colocate.resources.packing import ResourceRequest
from services.autoscaler import Autoscaler
from services.config import ServiceConfig
from services.distributed import setup_distributed
from services.errors import ServiceAsleepError, ServiceClosedError, ServiceUnavailableError
from services.replica import Health, Replica
from services.router import make_router

logger = logging.getLogger(__name__)
POLL_S = 0.002


class ServiceEndpoint:
    """`svc.<endpoint>`: `route` to one replica, `fanout` to all awake ones."""

    def __init__(self, service: Service, name: str) -> None:
        self.service, self.name = service, name

    async def route(self, *args: Any, session: str | None = None, **kwargs: Any) -> Any:
        return await self.service._route(self.name, args, kwargs, session)

    async def fanout(self, *args: Any, **kwargs: Any) -> list[Any]:
        return await self.service._fanout(self.name, args, kwargs)


class Service:
    """A set of replicas of one actor class, colocated through the resource manager."""

    def __init__(self, name: str, config: ServiceConfig, actor_class: type, rm: ResourceManager,
                 request: ResourceRequest, args: tuple = (), kwargs: dict | None = None) -> None:
        self.name, self.config, self.actor_class, self.rm = name, config, actor_class, rm
        self.request, self.args, self.kwargs = request, args, kwargs or {}
        self.replicas: list[Replica] = []
        self.autoscaler: Autoscaler | None = None
        self.router = make_router(config.router)
        self.endpoints = endpoint_names(actor_class)
        self.sessions: dict[str, int] = {}
        self._session_ids = itertools.count()
        self.closed = False
        self.waiting = 0  # calls waiting for a replica
        self.respawns: dict[int, asyncio.Task] = {}
        self.on_respawn: list[Callable[[Replica], Awaitable[None]]] = []
        self._loop = asyncio.get_running_loop()
        self._context = contextvars.copy_context()  # the client's Monarch context
        rm.drainers.append(self._drain)
        rm.failure_listeners.append(self._on_failure)

    def __getattr__(self, name: str) -> ServiceEndpoint:
        if name.startswith("_") or name not in self.__dict__.get("endpoints", ()):
            raise AttributeError(f"service {self.__dict__.get('name')!r} has no endpoint {name!r}")
        return ServiceEndpoint(self, name)

    def tenant_names(self) -> list[str]:
        """The arbiter's names for the replicas: `phase(svc)` wakes them all."""
        return [r.tenant for r in self.replicas if r.health is Health.HEALTHY]

    # -- routing -------------------------------------------------------------------------

    def _routable(self, exclude: set[int]) -> list[Replica]:
        return [r for r in self.replicas if r.health is Health.HEALTHY and not r.draining
                and r.index not in exclude and self.rm.routable(r.tenant)]

    def _how_to_wake(self) -> str:
        return (f"Wake it for the calls: `async with phase(service):` around them (this "
                f"service is {self.name!r}; `phase` is colocate.phase), or let calls wake it "
                "with ServiceConfig(when_asleep='wake').")

    def _awake_elsewhere(self) -> str:
        awake = sorted(n for n, up in self.rm.awake.items() if up)
        return ", ".join(awake) or "nothing"

    async def _pick(self, session: str | None, exclude: set[int]) -> Replica:
        self.waiting += 1
        try:
            return await self._wait_for_replica(session, exclude)
        finally:
            self.waiting -= 1

    async def _wait_for_replica(self, session: str | None, exclude: set[int]) -> Replica:
        deadline = time.monotonic() + self.config.wait_timeout_s
        woken = False
        while True:
            if self.closed:
                raise ServiceClosedError(f"service {self.name!r} is shut down")
            candidates = self._routable(exclude)
            if candidates:
                return self._choose(candidates, session)
            healthy = [r for r in self.replicas
                       if r.health is Health.HEALTHY and r.index not in exclude]
            if not healthy and self.respawns:  # the last ones are coming back: wait for them
                if time.monotonic() > deadline:
                    raise ServiceUnavailableError(
                        f"service {self.name!r}: no replica came back within "
                        f"{self.config.wait_timeout_s} s of a failure: " + self.failures())
                exclude.difference_update(self.respawns)  # a respawned one is a new replica
                await asyncio.sleep(POLL_S)
                continue
            if not healthy:
                raise ServiceUnavailableError(
                    f"service {self.name!r} has no healthy replica left: " + self.failures())
            if self.config.when_asleep == "fail":
                raise ServiceAsleepError(f"service {self.name!r} has no awake replica; "
                                         f"awake now: {self._awake_elsewhere()}. "
                                         + self._how_to_wake())
            if self.config.when_asleep == "wake" and not woken:
                woken = True
                await self.rm.wake(healthy[0].tenant)
                continue
            if time.monotonic() > deadline:
                raise ServiceAsleepError(
                    f"service {self.name!r}: no replica woke within "
                    f"{self.config.wait_timeout_s} s; awake now: {self._awake_elsewhere()}. "
                    + self._how_to_wake())
            await asyncio.sleep(POLL_S)

    def failures(self) -> str:
        """Each replica's health and, for a failed one, why; and what to do when a failed
        one will not come back by itself."""
        found = "; ".join(f"replica {r.index}: {r.health.value} ({r.failure})"
                          for r in self.replicas)
        if not self.config.respawn and any(r.health is Health.FAILED for r in self.replicas):
            found += (f"; service {self.name!r} does not respawn replicas (respawn=False), "
                      "so a failed one stays failed: spawn the service again")
        return found

    def _choose(self, candidates: list[Replica], session: str | None) -> Replica:
        if session is not None:
            for replica in candidates:
                if replica.index == self.sessions.get(session):
                    return replica
        replica = self.router.pick(candidates)
        if session is not None:
            self.sessions[session] = replica.index
        return replica

    async def _route(self, endpoint: str, args: tuple, kwargs: dict,
                     session: str | None) -> Any:
        failed: set[int] = set()
        faults = 0
        while True:
            replica = await self._pick(session, failed)
            try:
                return await replica.call(endpoint, args, kwargs)
            except ActorError as err:
                if isinstance(err.exception, TagPausedError):
                    continue  # put to sleep under us: not a failure; route again
                if not _is_fault(err):
                    raise err.exception from None  # the endpoint's own error: the caller's
                fault: Exception = err
            except Exception as err:  # the replica's proc is gone, or unreachable
                fault = err
            self._fail(replica, fault)
            failed.add(replica.index)
            faults += 1
            if faults > self.config.max_retries:
                first = str(fault).splitlines()[0] if str(fault) else ""
                raise ServiceUnavailableError(
                    f"service {self.name!r}: {endpoint} failed on {faults} replica(s), "
                    f"max_retries={self.config.max_retries}; the last: "
                    f"{type(fault).__name__}: {first}. {self.failures()}") from fault

    async def _fanout(self, endpoint: str, args: tuple, kwargs: dict) -> list[Any]:
        """Every awake, healthy replica; when none is, the when_asleep policy first."""
        picked = None if self._routable(set()) else await self._pick(None, set())
        replicas = self._routable(set()) or [picked]
        return list(await asyncio.gather(*(r.call(endpoint, args, kwargs) for r in replicas)))

    def lose(self, replica: Replica, err: BaseException) -> bool:
        """For callers that reach a replica's actors directly: True when `err` says the
        replica itself is gone (its proc died, its actor crashed), after marking it failed
        (and respawning it); False when the call merely raised, which is the caller's."""
        if isinstance(err, ActorError) and not _is_fault(err):
            return False
        self._fail(replica, err)
        return True

    def _fail(self, replica: Replica, err: BaseException | str) -> None:
        if replica.health is not Health.HEALTHY:
            return
        why = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
        logger.warning("service %r replica %d failed: %s", self.name, replica.index, why)
        replica.mark_failed(why.splitlines()[0])
        if self.config.respawn and not self.closed and replica.index not in self.respawns:
            self.respawns[replica.index] = asyncio.ensure_future(self._respawn(replica))

    def _on_failure(self, tenant: str, why: str) -> None:
        """Monarch supervision saw `tenant` fail (called on Monarch's thread)."""
        for replica in self.replicas:
            if replica.tenant == tenant:
                self._loop.call_soon_threadsafe(self._fail, replica, why, context=self._context)

    async def _respawn(self, replica: Replica) -> None:
        """Start the replica again on new procs for the same slots; until then, calls go
        to the other replicas."""
        try:
            await self.rm.remove(replica.tenant, replica.actors)
            allocation = await self.rm.replace_procs(replica.allocation)
            base, _, generation = replica.tenant.partition("_g")
            tenant = f"{base}_g{int(generation or 0) + 1}"
            actors = await self._start(tenant, allocation)
            replica.tenant, replica.actors, replica.allocation = tenant, actors, allocation
            for hook in self.on_respawn:
                await hook(replica)
            replica.health, replica.failure, replica.respawned = Health.HEALTHY, None, \
                replica.respawned + 1
            logger.info("service %r replica %d is back as %s", self.name, replica.index, tenant)
        except Exception as err:
            logger.exception("service %r: respawning replica %d failed", self.name,
                             replica.index)
            replica.failure = f"{replica.failure}; its respawn failed: {type(err).__name__}: {err}"
        finally:
            self.respawns.pop(replica.index, None)

    @asynccontextmanager
    async def session(self) -> AsyncIterator[str]:
        """A session id: calls routed with it stick to one replica while it can take them."""
        session = f"{self.name}-{next(self._session_ids)}"
        try:
            yield session
        finally:
            self.sessions.pop(session, None)

    # -- replicas ----------------------------------------------------------------------

    async def add_replica(self) -> Replica:
        """Allocate procs in the service's resource group and start one more replica."""
        index = len(self.replicas)
        allocation = await self.rm.allocate(self.request, owner=self.name)
        tenant = f"{self.name}_r{index}"  # Monarch drops dots from mesh names
        try:
            actors = await self._start(tenant, allocation)
        except BaseException:
            self.rm.free(allocation)
            raise
        replica = Replica(index, tenant, allocation, actors)
        self.replicas.append(replica)
        return replica

    async def _start(self, tenant: str, allocation: Allocation) -> Any:
        """Spawn the replica's actors; a multi-proc replica first gets its torch.distributed
        environment (RANK, WORLD_SIZE, MASTER_ADDR...), read by the actors' __init__."""
        if len(allocation.slots) > 1:
            await setup_distributed(allocation)
        return await self.rm.spawn(tenant, self.actor_class, allocation, *self.args,
                                   **self.kwargs)

    async def remove_replica(self, replica: Replica, grace_s: float | None = None) -> None:
        """Stop routing to the replica, let its calls finish, then stop it and free its procs."""
        replica.draining = True
        await self._drain({replica.tenant}, grace_s)
        await self.rm.remove(replica.tenant, replica.actors)
        self.rm.free(replica.allocation)
        replica.health = Health.STOPPED

    # -- switches and shutdown --------------------------------------------------------

    async def _drain(self, tenants: set[str], timeout_s: float | None = None) -> None:
        """Wait until the replicas of `tenants` have no call in flight (the resource manager
        stopped routing to them before calling this)."""
        deadline = time.monotonic() + (timeout_s or self.config.wait_timeout_s)
        while any(r.in_flight for r in self.replicas if r.tenant in tenants):
            if time.monotonic() > deadline:
                logger.warning("service %r: calls still in flight after %s s; switching anyway",
                               self.name, timeout_s or self.config.wait_timeout_s)
                return
            await asyncio.sleep(POLL_S)

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """Take no new calls, let the ones in flight finish, then stop the replicas' actors
        and free their procs (the resource group keeps its procs for other services)."""
        self.closed = True
        if self.autoscaler is not None:
            await self.autoscaler.stop()
        for task in list(self.respawns.values()):
            await task
        await self._drain({r.tenant for r in self.replicas}, grace_s)
        for replica in self.replicas:
            if replica.health is not Health.STOPPED:
                await self.remove_replica(replica, grace_s)
        if self._drain in self.rm.drainers:
            self.rm.drainers.remove(self._drain)
        if self._on_failure in self.rm.failure_listeners:
            self.rm.failure_listeners.remove(self._on_failure)


def _is_fault(err: ActorError) -> bool:
    """An ActorError that says the replica itself is broken, not that the call raised."""
    return isinstance(err.exception, (SystemExit, KeyboardInterrupt, MemoryError))
