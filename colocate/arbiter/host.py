"""The arbiter on Monarch: the per-host `Arbiter` actor around the host's `SlotArbiter`,
and `ActorTenantHandle`, how it reaches one tenant actor on one proc."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from monarch.actor import Actor, ActorError, concurrent_endpoint

from colocate.arbiter import room
from colocate.arbiter.config import ArbiterConfig
from colocate.arbiter.core import SlotArbiter
from colocate.arbiter.errors import ArbiterError
from colocate.arbiter.plan import Plan, PlanResult
from colocate.arbiter.proc_watch import PidWatch
from colocate.arbiter.slot import SlotTraffic
from colocate.arbiter.tenant import TenantInfo


@dataclass
class ActorTenantHandle:
    """Reaches one tenant actor on one proc (a one-proc slice of its actor mesh).

    A call that fails other than by the endpoint's own exception (Monarch reports the
    actor or its proc failed) marks the tenant lost, and later calls raise at once without
    sending: in Monarch 0.7.0 a message to a failed actor comes back undeliverable and
    fails the sender, the arbiter itself, whatever `_handle_undeliverable_message` says.
    """

    name: str
    actor: Any
    lost: str | None = None  # why, once a call found the tenant's actor or proc failed

    async def _call(self, endpoint: str, *args: Any) -> Any:
        if self.lost is not None:
            raise ArbiterError(f"tenant {self.name!r} is lost ({self.lost}); not called again")
        try:
            return await getattr(self.actor, endpoint).call_one(*args)
        except ActorError as err:  # the endpoint raised: the tenant is fine
            raise err.exception from None
        except Exception as err:
            self.lost = (str(err).strip().splitlines() or [type(err).__name__])[-1][:200]
            raise

    async def sleep(self, stages: Sequence[str] | None = None,
                    places: Mapping[str, str] | None = None) -> int:
        return await self._call("sleep", None if stages is None else list(stages),
                                None if places is None else dict(places))

    async def wake(self, stages: Sequence[str]) -> None:
        await self._call("wake", list(stages))

    async def describe(self) -> TenantInfo:
        return await self._call("describe")

    async def known_as(self, capacity: int | None = None) -> None:
        """Tell the tenant the name it has here and its slot's capacity
        (`TenantActor.known_as`)."""
        await self._call("known_as", self.name, capacity)

    async def receive(self, source: str) -> int:
        return await self._call("receive", source)

    async def run_plan(self, plan: Plan) -> PlanResult:
        return await self._call("run_plan", plan)


HostStatus = dict[int, dict[str, list[str] | None]]  # slot -> tenant -> awake stages


@dataclass(frozen=True)
class HostView:
    """A host's answer to a switch: who is awake on each slot, the slots that have nothing
    to decide (`room.roomy`: all awake, every working memory fits), and the tenant holding
    each slot's working memory under a policy that measures (`Slot.holder`). `seq` orders
    the views of one arbiter: switches on other slots of the host run concurrently, so
    their answers may arrive in another order than they were taken."""

    status: HostStatus
    roomy: frozenset[int]
    holders: dict[int, str]
    seq: int


class Arbiter(Actor):
    """One per host: the `SlotArbiter` of that host's slots, reached by message.

    Endpoints run concurrently; the per-slot locks inside serialize what conflicts. A switch
    answers with the host's view after it (`HostView`): the caller needs no second call.
    It also watches the host's slot procs, switch or not (`watch_pids`, `next_dead`: see
    `proc_watch`).
    """

    def __init__(self, slots: list[int], config: ArbiterConfig | None = None) -> None:
        self.core = SlotArbiter(slots, config)
        self.pid_watch = PidWatch()
        self._views = itertools.count(1)  # `HostView.seq`

    @concurrent_endpoint
    async def register(self, slot: int, name: str, actor: Any) -> TenantInfo:
        handle = ActorTenantHandle(name, actor)
        measured = self.core.policy.measures
        await handle.known_as(self.core.config.slot_capacity_bytes if measured else None)
        return await self.core.register(slot, handle)

    @concurrent_endpoint
    async def unregister(self, name: str, slots: list[int] | None = None) -> None:
        await self.core.unregister(name, slots)

    @concurrent_endpoint
    async def wake(self, name: str, slots: list[int] | None = None,
                   stages: list[str] | None = None) -> HostView:
        await self.core.wake(name, slots, stages)
        return self._view()

    @concurrent_endpoint
    async def make_room(self, name: str, asked_bytes: int,
                        slots: list[int] | None = None) -> HostView:
        await self.core.make_room(name, asked_bytes, slots)
        return self._view()

    @concurrent_endpoint
    async def sleep(self, name: str, slots: list[int] | None = None) -> HostView:
        await self.core.sleep(name, slots)
        return self._view()

    @concurrent_endpoint
    async def handoff(self, source: str, target: str, slots: list[int] | None = None,
                      keep: list[str] | None = None, first: list[str] | None = None
                      ) -> tuple[int, HostView]:
        copied = await self.core.handoff(source, target, slots, keep or ["weights"],
                                         first or ["weights"])
        return copied, self._view()

    @concurrent_endpoint
    async def status(self) -> HostStatus:
        return self.core.status()

    @concurrent_endpoint
    async def view(self) -> HostView:
        return self._view()

    def _view(self) -> HostView:
        core = self.core
        slots = core.slots.items()
        return HostView(core.status(),
                        frozenset(i for i, slot in slots if room.roomy(slot, core.config,
                                                                       core.policy)),
                        {i: slot.holder for i, slot in slots if slot.holder is not None},
                        next(self._views))

    @concurrent_endpoint
    async def traffic(self) -> dict[int, SlotTraffic]:
        """Per slot: what its switches moved so far."""
        return self.core.traffic()

    @concurrent_endpoint
    async def host_memory(self) -> dict[str, int | str | None]:
        """This host's backups: capacity, peaks, held now (`SlotArbiter.host_memory`)."""
        return self.core.host_memory()

    @concurrent_endpoint
    async def kill(self, pids: list[int]) -> None:
        """SIGKILL this host's procs `pids` (a hung replica's: SIGKILL ends a stopped one
        too); its pid watch then finds them dead."""
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    @concurrent_endpoint
    async def find_lost(self, names: list[str]) -> dict[str, str]:
        return self.core.find_lost(names)

    @concurrent_endpoint
    async def watch_pids(self, version: int, pids: list[int]) -> None:
        """Watch exactly `pids` (this host's procs that run spawned actors) from now on."""
        self.pid_watch.watch(version, pids)

    @concurrent_endpoint
    async def next_dead(self, timeout_s: float) -> list[int]:
        """The watched pids that died, as soon as one has; [] after `timeout_s`."""
        return await self.pid_watch.next_dead(timeout_s)

    @concurrent_endpoint
    async def close_watch(self) -> None:
        """End the pid watch: polls under way and later ones answer [] at once."""
        self.pid_watch.close()
