"""The switch protocol on the client side: the per-host arbiters, and every switch made
through them.

Every switch (wake, sleep, make room, a handoff) goes through `Switchboard`: it marks the
tenants the switch may put to sleep as switching (`HostsView.awake_now` is False for
them), lets its listeners (services) drain their calls in flight, asks each host's arbiter
in parallel, and records the hosts' answers in its `HostsView`. Under a policy that
measures, a wake of some stages of a tenant (or a handoff to it) may put its others to
sleep: it marks the tenant itself switching too. Listeners hear of each change of the view.
Work that moves memory between tenants without an arbiter (an in-place copy,
`resources.in_place`) holds them the same way (`run_held`), and their switches wait for
it as the arbiter's slot lock makes its own switches wait.
Tenants an arbiter finds lost are reported to `on_lost` at once, from a switch's error or
the liveness checks made while a drain waits. With `preempt=True`, a switch first asks the
`@preemptible` calls running in the tenants it may put to sleep to return what they have
(`colocate.arbiter.preempt`, through the `Preempter` beside each), then drains as ever.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, TypeVar

from colocate import watching
from colocate.abortable import Abortable
from colocate.arbiter.actor import remote_errors
from colocate.arbiter.config import ArbiterConfig
from colocate.arbiter.errors import SwitchAbortedError, TenantLostError
from colocate.arbiter.host import Arbiter, HostStatus, HostView
from colocate.arbiter.preempt import Preempters
from colocate.arbiter.slot import SlotTraffic
from colocate.resources.groups import Allocation
from colocate.resources.hosts_view import HostsView, Slot
from colocate.resources.listener import Listener
from colocate.resources.procs import SlotProcs, bootstrap_command, rank_of, select, stop_procs

T = TypeVar("T")
DRAIN_LIVENESS_S = 0.25  # while a drain or a held copy waits: how often the procs are checked
logger = logging.getLogger(__name__)


class Switchboard:
    """The arbiters of a runtime's hosts, the switches made through them, and their view."""

    def __init__(self, config: ArbiterConfig,
                 on_lost: Callable[[tuple[str, ...], str], None]) -> None:
        self.config = config
        self.on_lost = on_lost  # told of tenants an arbiter found lost: names, why
        self.view = HostsView(config.make_policy().measures)
        self.listeners: list[Listener] = []  # drain and changed
        # name -> the `Preempter` actors on its procs (tenants with @preemptible endpoints)
        self.preempters = Preempters(config.preempt_timeout_s)
        self.copies = InPlaceCopies()
        self._under_way = Abortable()  # the switches: a shutdown ends them
        self._procs: SlotProcs | None = None
        self._arbiters: Any = None

    async def start(self, host_mesh: Any, slots_per_host: int,
                    fork_server: str | None = None) -> None:
        """Start one `Arbiter` per host, on a proc of its own (forked from `fork_server` when
        given), for `slots_per_host` slots."""
        procs = host_mesh.spawn_procs(
            per_host={"procs": 1}, bootstrap_command=bootstrap_command(lambda point: {},
                                                                       fork_server))
        self._procs = SlotProcs(procs, (), ())
        self._arbiters = procs.spawn("arbiter", Arbiter, list(range(slots_per_host)),
                                     self.config)
        await self._arbiters.status.call()

    def abort(self) -> None:
        """End every switch under way, and every later one, with `SwitchAbortedError` (the
        runtime is shutting down: its arbiters will not answer)."""
        self._under_way.abort(lambda: SwitchAbortedError(
            "the runtime was shut down before this switch ended; who is awake is not known. "
            "Start a new runtime with `colocate.init(...)` to switch again"))

    async def stop(self, grace_s: float) -> None:
        """Stop the arbiters' procs."""
        if self._procs is not None:
            await stop_procs(self._procs, grace_s)
            self._procs = None

    @property
    def arbiter_procs(self) -> Any:
        """The proc mesh of the arbiters (None before `start` and after `stop`)."""
        return None if self._procs is None else self._procs.procs

    def arbiter(self, host: int) -> Any:
        """The arbiter actor of `host`."""
        return select(self._arbiters, hosts=host)

    # -- tenants ---------------------------------------------------------------------

    async def register(self, name: str, actors: Any, allocation: Allocation,
                       preempters: Any = None) -> None:
        """Register a started tenant with the arbiters of its slots (on all or on none);
        `preempters`: the `Preempter`s on its procs, when it has preemptible endpoints."""
        self.view.add(name, list(allocation.slots), actors)
        if preempters is not None:
            self.preempters.actors[name] = preempters
        per_host = allocation.procs_per_host
        try:
            async with remote_errors():
                infos = await asyncio.gather(*(
                    self.arbiter(host).register.call_one(
                        slot, name, rank_of(actors, i, per_host))
                    for i, (host, slot) in enumerate(allocation.slots)))
        except BaseException:  # registered nowhere, or everywhere it was undone
            await asyncio.gather(*(self.arbiter(host).unregister.call_one(name, [slot])
                                   for host, slot in allocation.slots), return_exceptions=True)
            self.forget(name)
            raise
        self.view.added(name, list(infos))
        await self.refresh()

    async def unregister(self, name: str) -> None:
        """Take a tenant off its arbiters and forget it."""
        if not self.view.is_tenant(name):
            return
        async with remote_errors():
            await asyncio.gather(*(self.arbiter(h).unregister.call_one(name, slots)
                                   for h, slots in self.view.by_host(name).items()))
        self.forget(name)

    def forget(self, name: str) -> None:
        """Forget a tenant here only (its arbiters no longer know it, or its slots are gone)."""
        self.view.forget(name)
        self.preempters.actors.pop(name, None)

    def forget_slots(self, slots: set[Slot]) -> list[str]:
        """Forget the tenants on any of `slots` (their procs were stopped); returns them."""
        names = self.view.on_slots(slots)
        for name in names:
            self.forget(name)
        return names

    # -- switches --------------------------------------------------------------------

    async def wake(self, name: str, stages: list[str] | None = None,
                   preempt: bool = False) -> None:
        """Make `name` awake on all its slots; its hosts switch in parallel. (The caller
        skips a tenant that is ready.) With `preempt`, the neighbours' running preemptible
        calls are asked to return what they have instead of being waited for."""
        by_host = self.view.by_host(name)
        touched = self.view.neighbours(name)
        if self.view.measures and stages is not None \
                and not set(self.view.stages[name]) <= set(stages):
            touched.add(name)  # its stages not asked may sleep to make room
        await self.switch(touched, lambda: {
            h: self.arbiter(h).wake.call_one(name, slots, stages)
            for h, slots in by_host.items()}, preempt)

    async def make_room(self, name: str, asked_bytes: int) -> None:
        """A call of `name` asked `asked_bytes` more than its slots had free: its arbiters
        learn the larger need and make the room (`SlotArbiter.make_room`)."""
        by_host = self.view.by_host(name)
        await self.switch(self.view.neighbours(name), lambda: {
            h: self.arbiter(h).make_room.call_one(name, asked_bytes, slots)
            for h, slots in by_host.items()})

    async def sleep(self, name: str) -> None:
        """Put `name` to sleep on all its slots, verified."""
        by_host = self.view.by_host(name)
        await self.switch({name}, lambda: {
            h: self.arbiter(h).sleep.call_one(name, slots) for h, slots in by_host.items()})

    async def switch(self, touched: set[str],
                     calls: Callable[[], dict[int, Awaitable[HostView]]],
                     preempt: bool = False) -> None:
        """Make arbiter calls (host -> call) that may put `touched` to sleep: first mark
        them switching and let the listeners drain their in-flight requests (with `preempt`,
        their preemptible calls asked to return first: `Preempters.ask`); after, record the
        hosts' answers in the view (every host's, when a call failed and left its host's
        state unknown). `calls` makes the calls only when invoked: a Monarch call is sent
        when it is made, not when it is awaited, so making them before the drain would
        race it."""
        with self._marked(touched):
            await self._under_way.run(self._drain_then_call(touched, calls, preempt))

    async def run_held(self, touched: set[str], work: Callable[[], Awaitable[T]]) -> T:
        """`work()`'s answer, run with `touched` held as for a switch but with no arbiter
        call (an in-place copy between their procs): marked switching (routing to them
        waits), their calls in flight drained, and their switches waiting until it ends."""
        with self._marked(touched):
            async with self.copies.running_on(touched):
                await self._under_way.run(self._drain(touched, copies=False))
                return await self._under_way.run(work())

    @contextmanager
    def _marked(self, touched: set[str]) -> Iterator[None]:
        """`touched` switching for the block; the listeners hear of the change after."""
        self.view.switching.update(touched)
        try:
            yield
        finally:
            self.view.switching.subtract(touched)
            self._changed()

    async def _drain_then_call(self, touched: set[str],
                               calls: Callable[[], dict[int, Awaitable[HostView]]],
                               preempt: bool = False) -> None:
        asked = sorted(n for n in touched if n in self.preempters.actors) if preempt else []
        try:
            if asked:
                await self.preempters.ask(asked, self.view.awake_tenants)
            await self._drain(touched)
        finally:
            if asked:
                await self.preempters.end(asked)
        pending = calls()
        try:
            async with remote_errors():
                answers = await asyncio.gather(*pending.values())
        except BaseException as err:
            if isinstance(err, TenantLostError):
                self.on_lost(err.tenants, str(err))
            if not self._under_way.aborted:
                await self.refresh()  # before routing resumes: the old view is stale now
            raise
        self.view.record(dict(zip(pending, answers, strict=True)))

    async def _drain(self, touched: set[str], copies: bool = True) -> None:
        """Let the listeners drain `touched` (with `copies`: and wait for the in-place
        copies from or into them). A call in flight in a proc that died would hold the
        drain until Monarch gives up on it, so the drain is watched (`colocate.watching`):
        every `DRAIN_LIVENESS_S` the arbiters check that those tenants' procs run; the lost
        ones are reported (`on_lost`), and their services end those calls."""
        async def check() -> None:
            await self.find_lost(touched)

        await watching.watched(asyncio.gather(
            *(listener.drain(touched) for listener in list(self.listeners)),
            *([self.copies.ended(touched)] if copies else [])), DRAIN_LIVENESS_S, check)

    async def find_lost(self, names: set[str]) -> dict[str, str]:
        """Report those of `names` whose procs died (`on_lost`); returns them: name -> why."""
        hosts = {host for name in names if name in self.view.tenants
                 for host, _ in self.view.tenants[name]}
        found = await asyncio.gather(*(self.arbiter(h).find_lost.call_one(sorted(names))
                                       for h in hosts))
        lost = {name: why for each in found for name, why in each.items()}
        for name, why in lost.items():
            self.on_lost((name,), why)
        return lost

    async def kill(self, procs: list[tuple[int, int]]) -> None:
        """SIGKILL `procs` ((host, pid) pairs), each by its host's arbiter."""
        by_host: dict[int, list[int]] = {}
        for host, pid in procs:
            by_host.setdefault(host, []).append(pid)
        await asyncio.gather(*(self.arbiter(h).kill.call_one(pids)
                               for h, pids in by_host.items()))

    async def status(self) -> dict[int, HostStatus]:
        """host -> slot -> tenant -> awake stages ([] asleep, None unknown)."""
        return await self._each_host("status")

    async def traffic(self) -> dict[int, dict[int, SlotTraffic]]:
        """host -> slot -> what its switches moved so far."""
        return await self._each_host("traffic")

    async def host_memory(self) -> dict[int, dict[str, int | str | None]]:
        """host -> its backups' capacity, peaks and what they hold now
        (`colocate.arbiter.host_budget.HostLedger.summary`)."""
        return await self._each_host("host_memory")

    async def _each_host(self, endpoint: str) -> dict[int, Any]:
        """host -> what its arbiter's `endpoint` answers."""
        found = await getattr(self._arbiters, endpoint).call()
        return {point["hosts"] if "hosts" in dict(point) else 0: value
                for point, value in found.items()}

    async def refresh(self) -> None:
        """Ask every arbiter for its view and record it."""
        self.view.record(await self._each_host("view"))
        self._changed()

    def _changed(self) -> None:
        for listener in list(self.listeners):
            listener.changed()


class InPlaceCopies:
    """The in-place copies under way (`Switchboard.run_held`), counted per tenant (source
    and target): a switch of any of them waits until they end."""

    def __init__(self) -> None:
        self.running: Counter[str] = Counter()
        self._ended = asyncio.Condition()

    def busy(self, names: Collection[str]) -> bool:
        return any(self.running[name] > 0 for name in names)

    async def ended(self, names: Collection[str]) -> None:
        """Return once no copy runs from or into `names`."""
        async with self._ended:
            await self._ended.wait_for(lambda: not self.busy(names))

    @asynccontextmanager
    async def running_on(self, names: Collection[str]) -> AsyncIterator[None]:
        """Count a copy between `names` for the block's length."""
        self.running.update(names)
        try:
            yield
        finally:
            self.running.subtract(names)
            async with self._ended:
                self._ended.notify_all()
