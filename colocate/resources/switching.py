"""The switch protocol on the client side: the per-host arbiters, the tenants registered
with them, and the cached view of who is awake.

Every switch (wake, sleep, handoff) goes through `Switchboard`: it marks the tenants the
switch may put to sleep as switching (`awake_now` is False for them), lets its watchers
(services) drain their calls in flight, asks each host's arbiter in parallel, and keeps the
hosts' answers as its view (`HostView`): each tenant's stages awake on all its slots, and
the slots that have nothing to decide (roomy). A wake the view says has nothing to do is
skipped; a handoff on roomy slots is the copy alone (`handoffs`). Under a policy that
measures, a wake of some stages of a tenant (or a handoff to it) may put its others to
sleep: it marks the tenant itself switching too. Watchers hear of each change of the view.
Tenants an arbiter finds lost are reported to `on_lost` at once, from a switch's error or
the liveness checks made while a drain waits. With `preempt=True`, a switch first asks the
`@preemptible` calls running in the tenants it may put to sleep to return what they have
(`colocate.arbiter.preempt`, through the `Preempter` beside each), then drains as ever.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from colocate.abortable import Abortable
from colocate.arbiter.actor import remote_errors
from colocate.arbiter.config import ArbiterConfig
from colocate.arbiter.errors import (
    ArbiterError,
    SwitchAbortedError,
    TenantLostError,
)
from colocate.arbiter.host import Arbiter, HostStatus, HostView
from colocate.arbiter.slot import SlotTraffic
from colocate.resources.groups import Allocation
from colocate.resources.handoffs import DRAIN_LIVENESS_S, Handoffs, InPlaceCopies
from colocate.resources.preempting import Preempters
from colocate.resources.procs import SlotProcs, bootstrap_command, rank_of, select, stop_procs
from colocate.resources.watcher import Watcher

logger = logging.getLogger(__name__)


class Switchboard(Handoffs):
    """The arbiters of a runtime's hosts, the tenants registered with them, and the view."""

    def __init__(self, config: ArbiterConfig,
                 on_lost: Callable[[tuple[str, ...], str], None]) -> None:
        self.config = config
        self.on_lost = on_lost  # told of tenants an arbiter found lost: names, why
        self.tenants: dict[str, list[tuple[int, int]]] = {}  # name -> (host, slot)
        self.stages: dict[str, tuple[str, ...]] = {}  # name -> its stages
        self.working: dict[str, int] = {}  # name -> its declared working memory
        self.pids: dict[str, dict[tuple[int, int], int]] = {}  # name -> (host, slot) -> pid
        self.awake: dict[str, frozenset[str]] = {}  # name -> awake on all its slots (last view)
        # under a policy that measures: (host, slot) -> the tenant whose working memory the
        # arbiter keeps free there (`HostView.holders`; another awake tenant's wake asks it)
        self.holders: dict[tuple[int, int], str] = {}
        # (host, slot)s with nothing to decide (`HostView.roomy`): any tenant there holds
        self.roomy: set[tuple[int, int]] = set()
        self.actors: dict[str, Any] = {}  # name -> its actor mesh (for in-place copies)
        self.copies = InPlaceCopies()
        self.measures = config.make_policy().measures
        self.host_status: dict[int, HostStatus] = {}  # the arbiters' answers, last view
        self._seqs: dict[int, int] = {}  # host -> `HostView.seq` of the view kept
        self.watchers: list[Watcher] = []  # drain and changed
        # name -> the `Preempter` actors on its procs (tenants with @preemptible endpoints)
        self.preempters = Preempters(config.preempt_timeout_s)
        self._switching: Counter[str] = Counter()
        self._under_way = Abortable()  # the switches: a shutdown ends them
        self._procs: SlotProcs | None = None
        self._arbiters: Any = None

    async def start(self, host_mesh: Any, slots_per_host: int) -> None:
        """Start one `Arbiter` per host, on a proc of its own, for `slots_per_host` slots."""
        procs = host_mesh.spawn_procs(per_host={"procs": 1},
                                      bootstrap_command=bootstrap_command(lambda point: {}))
        self._procs = SlotProcs(procs, ())
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
        self.tenants[name] = list(allocation.slots)
        self.actors[name] = actors
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
        self.stages[name] = infos[0].stages
        self.working[name] = max(info.working_bytes for info in infos)
        self.pids[name] = {slot: info.pid for slot, info in zip(allocation.slots, infos,
                                                                strict=True)}
        await self.refresh()

    async def unregister(self, name: str) -> None:
        """Take a tenant off its arbiters and forget it."""
        if name not in self.tenants:
            return
        async with remote_errors():
            await asyncio.gather(*(self.arbiter(h).unregister.call_one(name, slots)
                                   for h, slots in self._by_host(name).items()))
        self.forget(name)

    def forget(self, name: str) -> None:
        """Forget a tenant here only (its arbiters no longer know it, or its slots are gone)."""
        for table in (self.tenants, self.stages, self.working, self.pids, self.awake,
                      self.actors, self.preempters.actors):
            table.pop(name, None)
        self.holders = {slot: n for slot, n in self.holders.items() if n != name}

    def forget_slots(self, slots: set[tuple[int, int]]) -> list[str]:
        """Forget the tenants on any of `slots` (their procs were stopped); returns them."""
        names = [n for n, own in self.tenants.items() if slots.intersection(own)]
        for name in names:
            self.forget(name)
        return names

    def is_tenant(self, name: str) -> bool:
        return name in self.tenants

    def roomy_for(self, name: str) -> bool:
        """Whether every slot of `name` is roomy in the view (`room.roomy`): all its tenants
        awake and all their working memories fitting at once, so no call there needs a
        switch."""
        return all(s in self.roomy for s in self.tenants.get(name, ()))

    def slots_of(self, name: str) -> list[tuple[int, int]]:
        """The (host, slot)s of tenant `name`."""
        self._by_host(name)  # an unknown name fails here
        return list(self.tenants[name])

    def _by_host(self, name: str) -> dict[int, list[int]]:
        if name not in self.tenants:
            raise ArbiterError(f"unknown tenant {name!r}; tenants: {sorted(self.tenants)}")
        by_host: dict[int, list[int]] = {}
        for host, slot in self.tenants[name]:
            by_host.setdefault(host, []).append(slot)
        return by_host

    # -- switches --------------------------------------------------------------------

    async def wake(self, name: str, stages: list[str] | None = None,
                   preempt: bool = False) -> None:
        """Make `name` awake on all its slots; its hosts switch in parallel. (The caller
        skips a tenant that is `awake_now`.) With `preempt`, the neighbours' running
        preemptible calls are asked to return what they have instead of being waited for."""
        by_host = self._by_host(name)
        touched = self._neighbours(name)
        if self.measures and stages is not None and not set(self.stages[name]) <= set(stages):
            touched.add(name)  # its stages not asked may sleep to make room
        await self._switch(touched, lambda: {
            h: self.arbiter(h).wake.call_one(name, slots, stages)
            for h, slots in by_host.items()}, preempt)

    async def make_room(self, name: str, asked_bytes: int) -> None:
        """A call of `name` asked `asked_bytes` more than its slots had free: its arbiters
        learn the larger need and make the room (`SlotArbiter.make_room`)."""
        by_host = self._by_host(name)
        await self._switch(self._neighbours(name), lambda: {
            h: self.arbiter(h).make_room.call_one(name, asked_bytes, slots)
            for h, slots in by_host.items()})

    def holds(self, name: str) -> bool:
        """Whether `name` holds its slots' working memory (always, when the policy does
        not measure, it declares none, or its slots are roomy): then a wake of it, awake,
        has nothing to do."""
        return not self.measures or not self.working.get(name) or all(
            self.holders.get(s) == name or s in self.roomy for s in self.tenants.get(name, ()))

    async def sleep(self, name: str) -> None:
        """Put `name` to sleep on all its slots, verified."""
        by_host = self._by_host(name)
        await self._switch({name}, lambda: {
            h: self.arbiter(h).sleep.call_one(name, slots) for h, slots in by_host.items()})

    def _neighbours(self, name: str) -> set[str]:
        """The tenants that share a slot with `name`: a wake of `name` may put them to sleep."""
        mine = set(self.tenants[name])
        return {other for other, slots in self.tenants.items()
                if other != name and mine.intersection(slots)}

    async def _switch(self, touched: set[str],
                      calls: Callable[[], dict[int, Awaitable[HostView]]],
                      preempt: bool = False) -> None:
        """Make arbiter calls (host -> call) that may put `touched` to sleep: first mark
        them switching and let the watchers drain their in-flight requests (with `preempt`,
        their preemptible calls asked to return first: `Preempters.ask`); after, keep the
        hosts' answers as the view (every host's, when a call failed and left its host's
        state unknown). `calls` makes the calls only when invoked: a Monarch call is sent
        when it is made, not when it is awaited, so making them before the drain would
        race it."""
        self._switching.update(touched)
        try:
            await self._under_way.run(self._drain_then_call(touched, calls, preempt))
        finally:
            self._switching.subtract(touched)
            self._changed()

    async def _drain_then_call(self, touched: set[str],
                               calls: Callable[[], dict[int, Awaitable[HostView]]],
                               preempt: bool = False) -> None:
        asked = sorted(n for n in touched if n in self.preempters.actors) if preempt else []
        try:
            if asked:
                await self.preempters.ask(asked, self.awake_tenants)
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
        self._keep(dict(zip(pending, answers, strict=True)))

    async def _drain(self, touched: set[str], copies: bool = True) -> None:
        """Let the watchers drain `touched` (with `copies`: and wait for the in-place copies
        from or into them). A call in flight in a proc that died would hold
        the drain until Monarch gives up on it (seconds to minutes), so while the drain
        waits, the arbiters check every `DRAIN_LIVENESS_S` that those tenants' procs run;
        the lost ones are reported (`on_lost`), and their services end those calls."""
        drained = asyncio.ensure_future(asyncio.gather(
            *(watcher.drain(touched) for watcher in list(self.watchers)),
            *([self.copies.ended(touched)] if copies else [])))
        try:
            while not drained.done():
                await asyncio.wait({drained}, timeout=DRAIN_LIVENESS_S)
                if not drained.done():
                    await self._find_lost(touched)
            drained.result()
        finally:
            drained.cancel()

    async def _find_lost(self, names: set[str]) -> dict[str, str]:
        """Report those of `names` whose procs died (`on_lost`); returns them: name -> why."""
        hosts = {host for name in names if name in self.tenants
                 for host, _ in self.tenants[name]}
        found = await asyncio.gather(*(self.arbiter(h).find_lost.call_one(sorted(names))
                                       for h in hosts))
        lost = {name: why for each in found for name, why in each.items()}
        for name, why in lost.items():
            self.on_lost((name,), why)
        return lost

    def awake_now(self, name: str, stages: Collection[str] | None = None) -> bool:
        """`stages` (default: all of its own) awake on all its slots in the view, with no
        switch in flight that may put them to sleep."""
        up = self.awake.get(name)
        wanted = self.stages.get(name, ()) if stages is None else stages
        return up is not None and up.issuperset(wanted) and self._switching[name] <= 0

    def needed(self, name: str, stages: Collection[str] | None) -> tuple[str, ...]:
        """What a call that needs `stages` (None: every stage) needs of tenant `name`: those
        of its own stages, in its wake order (the others are not its to need)."""
        own = self.stages.get(name, ())
        return own if stages is None else tuple(s for s in own if s in stages)

    def awake_tenants(self) -> list[str]:
        """The tenants fully awake in the view, by name."""
        return sorted(name for name, up in self.awake.items()
                      if up and up.issuperset(self.stages.get(name, ())))

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

    async def _each_host(self, endpoint: str) -> dict[int, Any]:
        """host -> what its arbiter's `endpoint` answers."""
        found = await getattr(self._arbiters, endpoint).call()
        return {point["hosts"] if "hosts" in dict(point) else 0: value
                for point, value in found.items()}

    async def refresh(self) -> None:
        """Ask every arbiter for its view and keep it."""
        self._keep(await self._each_host("view"))
        self._changed()

    def _keep(self, views: dict[int, HostView]) -> None:
        """Keep hosts' answers as the view: who is awake, which slots are roomy. A view
        older than the one kept (a concurrent switch's, on other slots of the host,
        answered later) is dropped: it would undo what the newer one says."""
        for host, view in views.items():
            if view.seq <= self._seqs.get(host, 0):
                continue
            self._seqs[host] = view.seq
            self.host_status[host] = view.status
            self.roomy = {s for s in self.roomy if s[0] != host} | {
                (host, slot) for slot in view.roomy}
            self.holders = {s: n for s, n in self.holders.items() if s[0] != host} | {
                (host, slot): name for slot, name in view.holders.items()}
        self._update_awake()

    def _update_awake(self) -> None:
        status = self.host_status
        self.awake = {  # a slot whose state is unknown counts no stage awake
            name: frozenset.intersection(*(frozenset(status[h][slot].get(name) or ())
                                           for h, slot in slots))
            for name, slots in self.tenants.items()}

    def _changed(self) -> None:
        for watcher in list(self.watchers):
            watcher.changed()

