"""Autoscaling between min_replicas and max_replicas, on queue depth and utilization.

Every `interval_s`: when the calls in flight or waiting per routable replica exceed
`scale_up_queue_depth`, one replica is added (its procs asked of the resource manager; when
none fit, the reason is logged); when every replica was busy less than
`scale_down_utilization` of the time, the least loaded one is drained and removed. After
a change nothing moves for `scale_cooldown_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from colocate.resources.packing import ResourceError
from services.replica import Replica, ReplicaState

if TYPE_CHECKING:
    from services.service import Service

logger = logging.getLogger(__name__)


class Autoscaler:
    def __init__(self, service: Service, interval_s: float = 0.5) -> None:
        self.service = service
        self.interval_s = interval_s
        self.last_change = time.monotonic()
        self.history: list[tuple[float, int, str]] = []  # (time, replicas, why)
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    def live(self) -> list[Replica]:
        """The replicas not stopped (starting, serving, failed or coming back)."""
        return [r for r in self.service.replicas if r.state is not ReplicaState.STOPPED]

    async def _run(self) -> None:
        while not self.service.closed:
            await asyncio.sleep(self.interval_s)
            try:
                await self.step()
            except Exception:
                logger.exception("autoscaler of %r failed a step", self.service.name)

    async def step(self) -> None:
        svc, config = self.service, self.service.config
        live = self.live()
        for replica in live:  # read every step, so each reading covers one interval
            replica.load = replica.utilization()
        if time.monotonic() - self.last_change < config.scale_cooldown_s:
            return
        routable = svc._routable(set())
        demand = svc.waiting + sum(r.in_flight for r in live)
        depth = demand / max(1, len(routable))
        if depth > config.scale_up_queue_depth and len(live) < config.max:
            await self._scale_up(f"queue depth {depth:.1f} > {config.scale_up_queue_depth}")
        elif (len(live) > config.min and routable and svc.waiting == 0
              and max(r.load for r in live) < config.scale_down_utilization):
            await self._scale_down(f"utilization below {config.scale_down_utilization}")

    async def _scale_up(self, why: str) -> None:
        try:
            await self.service.add_replica()
        except ResourceError as err:
            logger.warning("service %r cannot scale up (%s): %s", self.service.name, why, err)
            self.last_change = time.monotonic()  # do not retry at once
            return
        self._changed(why)

    async def _scale_down(self, why: str) -> None:
        healthy = [r for r in self.live() if r.state is ReplicaState.HEALTHY]
        replica = min(healthy, key=lambda r: (r.in_flight, -r.index))
        await self.service.remove_replica(replica)
        self._changed(why)

    def _changed(self, why: str) -> None:
        self.last_change = time.monotonic()
        count = len(self.live())
        self.history.append((self.last_change, count, why))
        logger.info("service %r now has %d replicas: %s", self.service.name, count, why)
