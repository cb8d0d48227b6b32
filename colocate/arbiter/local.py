"""A tenant handle for a tenancy of this process (no actors).

Calls run on a worker thread, so a long pause or resume does not block the event loop.
Used where the arbiter and its tenants share one plain process: tests, single-GPU tools,
machines without Monarch. The handle has no `run_plan`: the arbiter carries out a
switch's plan through these calls itself, step by step (colocate.arbiter.delivery).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from colocate.arbiter.tenant import Tenancy, TenantInfo


@dataclass
class LocalTenantHandle:
    """Reaches `tenancy` (a `TaggedTenant`, or an engine's `.tenancy`); `receiver` (an
    engine's `receive(source)`) is given for a tenant that takes weights in a handoff."""

    name: str
    tenancy: Tenancy
    receiver: Callable[[str], int] | None = None

    async def sleep(self, stages: Sequence[str] | None = None,
                    places: Mapping[str, str] | None = None) -> int:
        return await asyncio.to_thread(self.tenancy.sleep, stages, places)

    async def wake(self, stages: Sequence[str]) -> None:
        await asyncio.to_thread(self.tenancy.wake, stages)

    async def describe(self) -> TenantInfo:
        return await asyncio.to_thread(self.tenancy.describe)

    async def receive(self, source: str) -> int:
        if self.receiver is None:
            raise TypeError(f"{self.name} takes no weights: give its handle a receiver to "
                            f"make it the target of a handoff from {source}")
        return await asyncio.to_thread(self.receiver, source)
