"""A tenant handle for a tenant object of this process (no actors).

Calls run on a worker thread, so a long pause or resume does not block the event loop.
Used where the arbiter and its tenants share one plain process: tests, single-GPU tools,
machines without Monarch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from colocate.arbiter.tenant import TaggedTenant, TenantInfo


@dataclass
class LocalTenantHandle:
    name: str
    tenant: TaggedTenant

    async def sleep(self) -> int:
        return await asyncio.to_thread(self.tenant.sleep)

    async def wake(self, stages: Sequence[str]) -> None:
        await asyncio.to_thread(self.tenant.wake, stages)

    async def describe(self) -> TenantInfo:
        return await asyncio.to_thread(self.tenant.describe)
