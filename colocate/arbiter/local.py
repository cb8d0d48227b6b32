"""A tenant handle for a tenant object of this process (no actors).

Calls run on a worker thread, so a long pause or resume does not block the event loop.
Used where the arbiter and its tenants share one plain process: tests, single-GPU tools,
machines without Monarch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from colocate.arbiter.tenant import TenantInfo


@dataclass
class LocalTenantHandle:
    """`tenant` has sleep(stages)/wake(stages)/describe() (a `TaggedTenant`, or an engine),
    and receive(source) when it takes weights."""

    name: str
    tenant: Any

    async def sleep(self, stages: Sequence[str] | None = None) -> int:
        return await asyncio.to_thread(self.tenant.sleep, stages)

    async def wake(self, stages: Sequence[str]) -> None:
        await asyncio.to_thread(self.tenant.wake, stages)

    async def describe(self) -> TenantInfo:
        return await asyncio.to_thread(self.tenant.describe)

    async def receive(self, source: str) -> int:
        return await asyncio.to_thread(self.tenant.receive, source)
