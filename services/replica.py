"""One replica of a service: its procs, its actors (a tenant of the arbiter), its health
and its load."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from colocate.resources.manager import Allocation


class Health(enum.Enum):
    HEALTHY = "healthy"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass
class Replica:
    index: int
    tenant: str  # the actor mesh's name, the key the arbiter knows it by
    allocation: Allocation
    actors: Any  # Monarch ActorMesh over the replica's procs
    health: Health = Health.HEALTHY
    failure: str | None = None
    in_flight: int = 0
    served: int = 0
    busy_s: float = 0.0
    respawned: int = 0
    draining: bool = False  # scaling down: takes no new calls
    load: float = 0.0  # busy fraction over the autoscaler's last interval
    _since: float = field(default_factory=time.monotonic)

    @property
    def procs(self) -> int:
        return len(self.allocation.slots)

    def mark_failed(self, why: str) -> None:
        self.health, self.failure = Health.FAILED, why

    async def call(self, endpoint: str, args: tuple, kwargs: dict) -> Any:
        """Call `endpoint` on every proc of the replica; the result of its rank 0."""
        method = getattr(self.actors, endpoint)
        self.in_flight += 1
        start = time.monotonic()
        try:
            if self.procs == 1:
                return await method.call_one(*args, **kwargs)
            results = await method.call(*args, **kwargs)
            return next(iter(results.items()))[1]
        finally:
            self.in_flight -= 1
            self.served += 1
            self.busy_s += time.monotonic() - start

    def utilization(self) -> float:
        """Busy fraction since the last call of this method."""
        now = time.monotonic()
        busy, self.busy_s = self.busy_s, 0.0
        elapsed, self._since = now - self._since, now
        return min(1.0, busy / elapsed) if elapsed > 0 else 0.0
