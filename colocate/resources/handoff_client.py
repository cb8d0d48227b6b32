"""The client's side of a handoff: passing weights between tenants that share procs
(`Handoffs.handoffs`); the arbiter's side, the plan on each slot, is
`colocate.arbiter.handoff_plan`.

A handoff goes through the arbiters of the target's hosts, staged, as a switch of the
`Switchboard`; or, where every slot of the source has nothing to decide (every tenant
wholly awake, every declared working memory fits: `room.roomy`), it is the copy alone, in
place with no switch (`InPlaceCopier`): one message to the target's procs instead of
client -> arbiter -> proc, the round trips that make most of a small RL step's switch time
on CPU (bench/RESULTS.md, "The ample share met").
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from colocate.arbiter.errors import ArbiterError
from colocate.arbiter.host import HostView
from colocate.resources.hosts_view import HostsView
from colocate.resources.in_place import InPlaceCopier
from colocate.resources.switching import Switchboard


class Handoffs:
    """The handoff verb, over the hosts' view and the switchboard's switches."""

    def __init__(self, view: HostsView, switchboard: Switchboard,
                 in_place: InPlaceCopier) -> None:
        self.view = view
        self.switchboard = switchboard
        self.in_place = in_place

    async def handoffs(self, source: str, targets: Sequence[str],
                       keep: list[str] | None = None, first: list[str] | None = None
                       ) -> dict[str, int]:
        """Pass `source`'s weights to each of `targets` on every slot they share, staged
        (see `SlotArbiter.handoff`), all at once (a sharded source gathers each bucket on
        all its ranks together); returns the bytes copied per target, or raises the first
        failure once all have ended. Afterwards the targets are awake and `source` asleep
        there (under a budget: awake where it fits). Where every slot of `source` is roomy,
        the copies are all there is to do: made in place with no switch
        (`InPlaceCopier.copy`)."""
        for target in targets:
            self._check(source, target)
        view = self.view
        if view.measures and view.roomy_for(source) \
                and all(view.awake_now(t) for t in targets) \
                and view.awake_now(source, keep or ("weights",)):
            return await self.in_place.copy(source, list(targets))
        return _each(targets, await asyncio.gather(
            *(self._hand_off(source, t, keep, first) for t in targets), return_exceptions=True))

    def _check(self, source: str, target: str) -> None:
        """Refuse a handoff between tenants that do not share all the target's procs."""
        view = self.view
        view.by_host(target)
        view.by_host(source)  # an unknown source fails here
        apart = set(view.tenants[target]) - set(view.tenants[source])
        if apart:
            raise ArbiterError(f"handoff {source} -> {target}: {source} is not on {target}'s "
                               f"(host, slot)s {sorted(apart)}; colocate them in one resource "
                               "group, or sync through shared memory (services.sync_weights)")
        other_procs = sorted(slot for slot, pid in view.pids[target].items()
                             if view.pids[source][slot] != pid)
        if other_procs:  # e.g. one of them was respawned on new procs for the same slots
            raise ArbiterError(f"handoff {source} -> {target}: on (host, slot)s {other_procs} "
                               "they live in different processes (a handoff copies within "
                               "one); sync through shared memory (services.sync_weights does "
                               "for replicas on other procs)")

    async def _hand_off(self, source: str, target: str, keep: list[str] | None,
                        first: list[str] | None) -> int:
        """One handoff through the arbiters of `target`'s hosts."""
        copied = 0
        board = self.switchboard

        async def on(host: int, slots: list[int]) -> HostView:
            nonlocal copied
            moved, view = await board.arbiter(host).handoff.call_one(
                source, target, slots, keep, first)
            copied += moved
            return view

        touched = self.view.neighbours(target) | {source}
        if self.view.measures:
            touched.add(target)  # its stages beyond the weights may sleep to make room
        await board.switch(
            touched, lambda: {h: on(h, slots) for h, slots in self.view.by_host(target).items()})
        return copied


def _each(targets: Sequence[str], results: list[int | BaseException]) -> dict[str, int]:
    """Bytes copied per target, or the first failure (each failed handoff rolled its slots
    back; the others are done)."""
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return dict(zip(targets, results, strict=True))  # type: ignore[arg-type]
