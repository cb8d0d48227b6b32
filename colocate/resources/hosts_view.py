"""The client's view of the hosts: the tenants registered with their arbiters, and what the
arbiters last said of them.

Every switch answers with its hosts' views (`HostView`); `HostsView.record` keeps them in
the order the arbiters took them (`HostView.seq`: switches on other slots of a host run
concurrently, so their answers may arrive out of order) and derives from them what routing
and the switches ask: which stages of each tenant are awake on all its slots, who holds
each slot's working memory (under a policy that measures), and which slots are roomy
(every tenant there awake, every declared working memory fitting at once). Beside the
view, the tenants that a switch in flight may put to sleep (`switching`): no call goes to
them until it ends. Nothing here sends a message; `Switchboard` asks the arbiters and
records their answers here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from typing import Any

from colocate.arbiter.errors import ArbiterError
from colocate.arbiter.host import HostStatus, HostView
from colocate.arbiter.tenant import TenantInfo

Slot = tuple[int, int]  # (host, slot)


class HostsView:
    """The registered tenants and the hosts' last answers about them (see module)."""

    def __init__(self, measures: bool) -> None:
        self.measures = measures  # the policy measures memory: holders matter
        self.tenants: dict[str, list[Slot]] = {}  # name -> its (host, slot)s
        self.stages: dict[str, tuple[str, ...]] = {}  # name -> its stages
        self.working: dict[str, int] = {}  # name -> its declared working memory
        self.pids: dict[str, dict[Slot, int]] = {}  # name -> (host, slot) -> pid
        self.actors: dict[str, Any] = {}  # name -> its actor mesh (for in-place copies)
        self.awake: dict[str, frozenset[str]] = {}  # name -> awake on all its slots
        # under a policy that measures: (host, slot) -> the tenant whose working memory the
        # arbiter keeps free there (`HostView.holders`; another awake tenant's wake asks it)
        self.holders: dict[Slot, str] = {}
        # (host, slot)s with nothing to decide (`HostView.roomy`): any tenant there holds
        self.roomy: set[Slot] = set()
        self.host_status: dict[int, HostStatus] = {}  # the arbiters' answers, last view
        self.switching: Counter[str] = Counter()  # name -> switches in flight touching it
        self._seqs: dict[int, int] = {}  # host -> `HostView.seq` of the view recorded

    # -- tenants ---------------------------------------------------------------------

    def add(self, name: str, slots: list[Slot], actors: Any) -> None:
        """A tenant being registered on `slots` (its arbiters' answers come with `added`)."""
        self.tenants[name] = list(slots)
        self.actors[name] = actors

    def added(self, name: str, infos: list[TenantInfo]) -> None:
        """What `name`'s arbiters answered its registration with, one per slot in order."""
        self.stages[name] = infos[0].stages
        self.working[name] = max(info.working_bytes for info in infos)
        self.pids[name] = {slot: info.pid for slot, info in zip(self.tenants[name], infos,
                                                                strict=True)}

    def forget(self, name: str) -> None:
        """Forget a tenant (its arbiters no longer know it, or its slots are gone)."""
        for table in (self.tenants, self.stages, self.working, self.pids, self.awake,
                      self.actors):
            table.pop(name, None)
        self.holders = {slot: n for slot, n in self.holders.items() if n != name}

    def on_slots(self, slots: set[Slot]) -> list[str]:
        """The tenants on any of `slots`."""
        return [n for n, own in self.tenants.items() if slots.intersection(own)]

    def is_tenant(self, name: str) -> bool:
        return name in self.tenants

    def slots_of(self, name: str) -> list[Slot]:
        """The (host, slot)s of tenant `name`."""
        self.by_host(name)  # an unknown name fails here
        return list(self.tenants[name])

    def by_host(self, name: str) -> dict[int, list[int]]:
        """host -> the slots of tenant `name` there; an unknown name raises `ArbiterError`."""
        if name not in self.tenants:
            raise ArbiterError(f"unknown tenant {name!r}; tenants: {sorted(self.tenants)}")
        by_host: dict[int, list[int]] = {}
        for host, slot in self.tenants[name]:
            by_host.setdefault(host, []).append(slot)
        return by_host

    def neighbours(self, name: str) -> set[str]:
        """The tenants that share a slot with `name`: a wake of `name` may put them to sleep."""
        mine = set(self.tenants[name])
        return {other for other, slots in self.tenants.items()
                if other != name and mine.intersection(slots)}

    def needed(self, name: str, stages: Collection[str] | None) -> tuple[str, ...]:
        """What a call that needs `stages` (None: every stage) needs of tenant `name`: those
        of its own stages, in its wake order (the others are not its to need)."""
        own = self.stages.get(name, ())
        return own if stages is None else tuple(s for s in own if s in stages)

    # -- the hosts' answers ------------------------------------------------------------

    def record(self, views: dict[int, HostView]) -> None:
        """Take hosts' answers as the view: who is awake, which slots are roomy, who holds
        each. A view older than the one recorded (a concurrent switch's, on other slots of
        the host, answered later) is dropped: it would undo what the newer one says."""
        for host, view in views.items():
            if view.seq <= self._seqs.get(host, 0):
                continue
            self._seqs[host] = view.seq
            self.host_status[host] = view.status
            self.roomy = {s for s in self.roomy if s[0] != host} | {
                (host, slot) for slot in view.roomy}
            self.holders = {s: n for s, n in self.holders.items() if s[0] != host} | {
                (host, slot): name for slot, name in view.holders.items()}
        status = self.host_status
        self.awake = {  # a slot whose state is unknown counts no stage awake
            name: frozenset.intersection(*(frozenset(status[h][slot].get(name) or ())
                                           for h, slot in slots))
            for name, slots in self.tenants.items()}

    def awake_now(self, name: str, stages: Collection[str] | None = None) -> bool:
        """`stages` (default: all of its own) awake on all its slots in the view, with no
        switch in flight that may put them to sleep."""
        up = self.awake.get(name)
        wanted = self.stages.get(name, ()) if stages is None else stages
        return up is not None and up.issuperset(wanted) and self.switching[name] <= 0

    def awake_tenants(self) -> list[str]:
        """The tenants fully awake in the view, by name."""
        return sorted(name for name, up in self.awake.items()
                      if up and up.issuperset(self.stages.get(name, ())))

    def holds(self, name: str) -> bool:
        """Whether `name` holds its slots' working memory (always, when the policy does
        not measure, it declares none, or its slots are roomy): then a wake of it, awake,
        has nothing to do."""
        return not self.measures or not self.working.get(name) or all(
            self.holders.get(s) == name or s in self.roomy for s in self.tenants.get(name, ()))

    def roomy_for(self, name: str) -> bool:
        """Whether every slot of `name` is roomy in the view (`room.roomy`): all its tenants
        awake and all their working memories fitting at once, so no call there needs a
        switch."""
        return all(s in self.roomy for s in self.tenants.get(name, ()))
