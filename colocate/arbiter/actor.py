"""The arbiter on Monarch: the per-host `Arbiter` actor and the `TenantActor` base class.

A `TenantActor` is a colocated actor (trainer, generator...) whose memory lives under
`colocate.memory` tags, one per stage; the arbiter reaches it through its own mailbox, so
a sleep is ordered after the tenant's in-flight work. Tenant endpoints are sync, so a
subclass's endpoints must be sync too (Monarch does not mix the two in one class).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

from monarch.actor import Actor, ActorError, concurrent_endpoint, current_actor_name, endpoint

from colocate.arbiter.core import ArbiterConfig, SlotArbiter
from colocate.arbiter.tenant import TaggedTenant, TenantInfo


class TenantActor(Actor):
    """Base class of actors that time-share their slots.

    `stages` maps each stage, in wake order, to whether its contents survive a sleep
    (weights: True; caches: False). Allocate a stage's memory inside
    `with self.tenancy.region(stage):`, or hand existing tensors to `self.tenancy.adopt`.
    Call `self.tenancy.ensure_awake()` before computing.
    """

    stages: ClassVar[dict[str, bool]] = {"state": True}

    @property
    def tenant_name(self) -> str:
        """The name this tenant has at the arbiter (its actor mesh's name)."""
        return current_actor_name().split("<", 1)[0]

    @property
    def tenancy(self) -> TaggedTenant:
        if "_tenancy" not in self.__dict__:
            prefix = self.tenant_name
            self._tenancy = TaggedTenant({s: f"{prefix}/{s}" for s in self.stages},
                                         backup=dict(self.stages))
        return self._tenancy

    @endpoint
    def sleep(self, stages: list[str] | None = None) -> int:
        return self.tenancy.sleep(stages)

    @endpoint
    def wake(self, stages: list[str]) -> None:
        self.tenancy.wake(stages)

    @endpoint
    def describe(self) -> TenantInfo:
        return self.tenancy.describe()

    @endpoint
    def receive(self, source: str) -> int:
        """Take the weights of tenant `source`, which lives in this process; returns the
        bytes copied. Tenants that take weights (generators) override this."""
        raise TypeError(f"{type(self).__name__} takes no weights: only a tenant that "
                        f"overrides receive() can be the target of a handoff from {source}")


@asynccontextmanager
async def remote_errors() -> AsyncIterator[None]:
    """Raise the exception a remote actor raised, not Monarch's wrapper around it (whose
    message carries the remote traceback)."""
    try:
        yield
    except ActorError as err:
        raise err.exception from None


@dataclass
class ActorTenantHandle:
    """Reaches one tenant actor on one proc (a one-proc slice of its actor mesh)."""

    name: str
    actor: Any

    async def sleep(self, stages: Sequence[str] | None = None) -> int:
        async with remote_errors():
            return await self.actor.sleep.call_one(None if stages is None else list(stages))

    async def wake(self, stages: Sequence[str]) -> None:
        async with remote_errors():
            await self.actor.wake.call_one(list(stages))

    async def describe(self) -> TenantInfo:
        async with remote_errors():
            return await self.actor.describe.call_one()

    async def receive(self, source: str) -> int:
        async with remote_errors():
            return await self.actor.receive.call_one(source)


HostStatus = dict[int, dict[str, list[str] | None]]  # slot -> tenant -> awake stages


class Arbiter(Actor):
    """One per host: the `SlotArbiter` of that host's slots, reached by message.

    Endpoints run concurrently; the per-slot locks inside serialize what conflicts. A switch
    answers with the host's status after it, so the caller's view needs no second call.
    """

    def __init__(self, slots: list[int], config: ArbiterConfig | None = None) -> None:
        self.core = SlotArbiter(slots, config)

    @concurrent_endpoint
    async def register(self, slot: int, name: str, actor: Any) -> TenantInfo:
        return await self.core.register(slot, ActorTenantHandle(name, actor))

    @concurrent_endpoint
    async def unregister(self, name: str, slots: list[int] | None = None) -> None:
        await self.core.unregister(name, slots)

    @concurrent_endpoint
    async def wake(self, name: str, slots: list[int] | None = None,
                   stages: list[str] | None = None) -> HostStatus:
        await self.core.wake(name, slots, stages)
        return self.core.status()

    @concurrent_endpoint
    async def sleep(self, name: str, slots: list[int] | None = None) -> HostStatus:
        await self.core.sleep(name, slots)
        return self.core.status()

    @concurrent_endpoint
    async def handoff(self, source: str, target: str, slots: list[int] | None = None,
                      keep: list[str] | None = None, first: list[str] | None = None
                      ) -> tuple[int, HostStatus]:
        copied = await self.core.handoff(source, target, slots, keep or ["weights"],
                                         first or ["weights"])
        return copied, self.core.status()

    @concurrent_endpoint
    async def status(self) -> HostStatus:
        return self.core.status()
