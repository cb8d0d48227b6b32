"""Autoscaling between min_replicas and max_replicas, on queue depth and utilization.

Every `interval_s`: when the calls in flight or waiting per ready replica exceed
`scale_up_queue_depth`, one replica is added (its procs asked of the resource manager; when
none fit, the reason is logged); when every replica was busy less than
`scale_down_utilization` of the interval, the least loaded one is drained and removed.
After a change nothing moves for `scale_cooldown_s`.

The autoscaler sees a service through a narrow interface: a `LoadSnapshot` (taken by the
service's `load_snapshot()`), and callables that add a replica and remove one by its index.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from colocate.resources.packing import ResourceError
from services.config import ServiceConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica that is not stopped (starting, serving, failed or coming back)."""

    index: int
    in_flight: int
    busy_s: float  # time spent in its finished calls so far (only grows)
    healthy: bool  # takes calls: may be drained and removed


@dataclass(frozen=True)
class LoadSnapshot:
    """A service's load at one moment."""

    replicas: tuple[ReplicaLoad, ...]  # those not stopped
    ready: int  # replicas that can take a call now (healthy and awake)
    waiting: int  # calls waiting for a replica


class Autoscaler:
    def __init__(self, name: str, config: ServiceConfig, load: Callable[[], LoadSnapshot],
                 add: Callable[[], Awaitable[object]], remove: Callable[[int], Awaitable[None]],
                 interval_s: float = 0.5) -> None:
        self.name, self.config = name, config
        self._load, self._add, self._remove = load, add, remove
        self.interval_s = interval_s
        self.last_change = time.monotonic()
        self.history: list[tuple[float, int, str]] = []  # (time, replicas, why)
        self.task: asyncio.Task | None = None
        self._busy: dict[int, tuple[float, float]] = {}  # index -> (when, busy_s) last read

    def start(self) -> None:
        self.task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    def live(self) -> list[ReplicaLoad]:
        """The replicas not stopped (starting, serving, failed or coming back)."""
        return list(self._load().replicas)

    async def _run(self) -> None:
        while True:  # until `stop` (the service stops it as it closes)
            await asyncio.sleep(self.interval_s)
            try:
                await self.step()
            except Exception:
                logger.exception("autoscaler of %r failed a step", self.name)

    def _utilization(self, replicas: tuple[ReplicaLoad, ...]) -> dict[int, float]:
        """Each replica's busy fraction since the last step (read every step, so each
        reading covers one interval); 1.0 for one not read before (not known to be idle)."""
        now = time.monotonic()
        found = {}
        for r in replicas:
            since, busy = self._busy.get(r.index, (now, r.busy_s))
            if now > since and r.busy_s >= busy:
                found[r.index] = min(1.0, (r.busy_s - busy) / (now - since))
            else:  # first read, or no longer the replica read before
                found[r.index] = 1.0
            self._busy[r.index] = (now, r.busy_s)
        return found

    async def step(self) -> None:
        config = self.config
        load = self._load()
        live = load.replicas
        utilization = self._utilization(live)
        if time.monotonic() - self.last_change < config.scale_cooldown_s:
            return
        demand = load.waiting + sum(r.in_flight for r in live)
        depth = demand / max(1, load.ready)
        if depth > config.scale_up_queue_depth and len(live) < config.max:
            await self._scale_up(f"queue depth {depth:.1f} > {config.scale_up_queue_depth}")
        elif (len(live) > config.min and load.ready and load.waiting == 0
              and max(utilization.values()) < config.scale_down_utilization):
            healthy = [r for r in live if r.healthy]
            await self._scale_down(min(healthy, key=lambda r: (r.in_flight, -r.index)),
                                   f"utilization below {config.scale_down_utilization}")

    async def _scale_up(self, why: str) -> None:
        try:
            await self._add()
        except ResourceError as err:
            logger.warning("service %r cannot scale up (%s): %s", self.name, why, err)
            self.last_change = time.monotonic()  # do not retry at once
            return
        self._changed(why)

    async def _scale_down(self, replica: ReplicaLoad, why: str) -> None:
        await self._remove(replica.index)
        self._changed(why)

    def _changed(self, why: str) -> None:
        self.last_change = time.monotonic()
        count = len(self.live())
        self.history.append((self.last_change, count, why))
        logger.info("service %r has %d replicas: %s", self.name, count, why)
