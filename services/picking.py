"""Which replica a routed call goes to, and the wait for one (`Picking`, a part of
`services.service.Service`).

A call goes to a replica whose tenant has the stages its endpoint needs (`colocate.needs`;
undeclared: every stage) awake on all its procs, as the arbiter reports; never to one
that a switch in flight may put to sleep (the resource manager drains them first). When
none is, `config.when_asleep` decides: wait (bounded), wake those stages, or fail with
`ServiceAsleepError`. While the last replicas come back from a failure (a respawn, or its
group's restart) the call waits for them, bounded too; with none left it fails with
`ServiceUnavailableError`, naming each replica's state (`failures`). The wait sleeps on the
service's `Changes` and looks again after each change, never polling.
"""

from __future__ import annotations

import asyncio

from colocate.resources.manager import ResourceManager
from colocate.resources.packing import ResourceRequest
from services.config import ServiceConfig
from services.errors import (
    ServiceAsleepError,
    ServiceClosedError,
    ServiceError,
    ServiceUnavailableError,
)
from services.holding import in_hooks
from services.replica import Replica, ReplicaState
from services.router import SessionRouter
from services.waiting import Changes


class Picking:
    """The replicas a call can go to now, and the wait for one, for a service (`Service`)
    with these attributes."""

    name: str
    config: ServiceConfig
    rm: ResourceManager
    request: ResourceRequest
    replicas: list[Replica]
    router: SessionRouter
    closed: bool
    waiting: int  # calls waiting for a replica
    held: str | None  # why routed calls wait: its group restarts
    _changes: Changes

    def _holding(self) -> bool:
        """Routed calls wait: the group restarts (calls from its restart hooks go on)."""
        return self.held is not None and not in_hooks(self.request.resource_group)

    def _ready(self, exclude: set[int]) -> list[Replica]:
        """The healthy replicas not in `exclude` (none while its group restarts)."""
        if self._holding():
            return []
        return [r for r in self.replicas
                if r.state is ReplicaState.HEALTHY and r.index not in exclude]

    def _routable(self, replicas: list[Replica],
                  stages: tuple[str, ...] | None = None) -> list[Replica]:
        """Those of `replicas` that can take a call needing `stages` (None: every stage)
        now, for the resource manager: those stages awake, no switch in flight."""
        return [r for r in replicas if self.rm.routable(r.tenant, stages)]

    def _how_to_wake(self) -> str:
        return (f"Wake it for the calls: `async with phase(service):` around them (this "
                f"service is {self.name!r}; `phase` is colocate.phase), or let calls wake it "
                "with ServiceConfig(when_asleep='wake').")

    def _awake_elsewhere(self) -> str:
        return ", ".join(self.rm.awake_tenants()) or "nothing"

    async def _pick(self, session: str | None, exclude: set[int],
                    stages: tuple[str, ...] | None) -> Replica:
        self.waiting += 1
        try:
            return await self._wait_for_replica(session, exclude, stages)
        finally:
            self.waiting -= 1

    async def _wait_for_replica(self, session: str | None, exclude: set[int],
                                stages: tuple[str, ...] | None) -> Replica:
        """A healthy replica not in `exclude` with `stages` awake; waits for one (bounded)
        as the replicas' states and the `when_asleep` policy say, woken by each change."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.wait_timeout_s
        woken = False
        late: ServiceError  # raised when the wait runs out
        while True:
            since = self._changes.version  # before looking: a change after it ends the wait
            if self.closed:
                raise ServiceClosedError(f"service {self.name!r} is shut down")
            healthy = self._ready(exclude)  # none while held: that case comes first below
            candidates = self._routable(healthy, stages)
            if candidates:
                return self.router.pick(candidates, session)
            coming = [r.index for r in self.replicas
                      if r.state in (ReplicaState.STARTING, ReplicaState.RECOVERING)]
            if self._holding():  # its group restarts: every replica comes back
                exclude.clear()
                late = ServiceUnavailableError(
                    f"service {self.name!r}: its resource group did not come back within "
                    f"{self.config.wait_timeout_s} s of a failure: {self.held}")
            elif not healthy and coming:  # the last ones are coming back: wait for them
                exclude.difference_update(coming)  # a respawned one is a new replica
                late = ServiceUnavailableError(
                    f"service {self.name!r}: no replica came back within "
                    f"{self.config.wait_timeout_s} s of a failure: " + self.failures())
            elif not healthy:
                raise ServiceUnavailableError(
                    f"service {self.name!r} has no healthy replica left: " + self.failures())
            elif self.config.when_asleep == "fail":
                raise ServiceAsleepError(f"service {self.name!r} has no awake replica; "
                                         f"awake now: {self._awake_elsewhere()}. "
                                         + self._how_to_wake())
            elif self.config.when_asleep == "wake" and not woken:
                woken = True
                await self.rm.wake_for(healthy[0].tenant, stages)
                continue
            else:
                late = ServiceAsleepError(
                    f"service {self.name!r}: no replica woke within "
                    f"{self.config.wait_timeout_s} s; awake now: {self._awake_elsewhere()}. "
                    + self._how_to_wake())
            left = deadline - loop.time()
            if left <= 0:
                raise late
            await self._changes.wait(since, left)

    def failures(self) -> str:
        """Each replica's state and, for a failed one, why; and what to do when a failed
        one will not come back by itself."""
        found = "; ".join(f"replica {r.index}: {r.state.value} ({r.failure})"
                          for r in self.replicas)
        if self.held is not None:
            found += f"; {self.held}"
        if not self.config.respawn and any(r.state is ReplicaState.FAILED for r in self.replicas):
            found += (f"; service {self.name!r} does not respawn replicas (respawn=False), "
                      "so a failed one stays failed: spawn the service again")
        return found
