"""Passing weights between tenants that share procs: `Handoffs.handoffs`, the handoff verb
of `Switchboard` (a mixin of it: it uses the switchboard's view, switches and drains).

Through the arbiters of the target's hosts, staged (`SlotArbiter.handoff`), or, where every
slot of the source has nothing to decide (every tenant wholly awake, every declared working
memory fits: `room.roomy`), in place with no switch: one message to the target's procs
instead of client -> arbiter -> proc, the round trips that make most of a small RL step's
switch time on CPU (bench/RESULTS.md, "The ample share met").
`InPlaceCopies` keeps the other switches of the tenants waiting until such a copy is done,
as the arbiter's slot lock does for the switches it runs; `copy_in_place` watches it as the
arbiter watches a plan.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from contextlib import asynccontextmanager
from typing import Any

from colocate.arbiter.actor import remote_errors
from colocate.arbiter.errors import ArbiterError, TenantLostError
from colocate.arbiter.host import HostView
from colocate.monarch_compat import SupervisionError

DRAIN_LIVENESS_S = 0.25  # while a drain or a copy waits: how often the procs are checked


class Handoffs:
    """The handoff verbs of `Switchboard`, which has the state and the switch they use:
    `tenants`, `pids`, `actors`, `roomy`, `measures`, `copies`, `config`, `awake_now`,
    `arbiter`, `kill`, `_switch`, `_drain`, `_neighbours`, `_find_lost`."""

    async def handoffs(self, source: str, targets: Sequence[str],
                       keep: list[str] | None = None, first: list[str] | None = None
                       ) -> dict[str, int]:
        """Pass `source`'s weights to each of `targets` on every slot they share, staged
        (see `SlotArbiter.handoff`), all at once (a sharded source gathers each bucket on
        all its ranks together); returns the bytes copied per target, or raises the first
        failure once all have ended. Afterwards the targets are awake and `source` asleep
        there (under a budget: awake where it fits). Where every slot of `source` is roomy,
        the copies are all there is to do: made in place with no switch (`_copy_in_place`)."""
        for target in targets:
            self._check_handoff(source, target)
        if self.measures and all(s in self.roomy for s in self.tenants[source]) \
                and all(self.awake_now(t) for t in targets) \
                and self.awake_now(source, keep or ("weights",)):
            return await self._copy_in_place(source, list(targets))
        return _each(targets, await asyncio.gather(
            *(self._hand_off(source, t, keep, first) for t in targets), return_exceptions=True))

    def _check_handoff(self, source: str, target: str) -> None:
        """Refuse a handoff between tenants that do not share all the target's procs."""
        self._by_host(target)
        self._by_host(source)  # an unknown source fails here
        apart = set(self.tenants[target]) - set(self.tenants[source])
        if apart:
            raise ArbiterError(f"handoff {source} -> {target}: {source} is not on {target}'s "
                               f"(host, slot)s {sorted(apart)}; colocate them in one resource "
                               "group, or sync through shared memory (services.sync_weights)")
        other_procs = sorted(slot for slot, pid in self.pids[target].items()
                             if self.pids[source][slot] != pid)
        if other_procs:  # e.g. one of them was respawned on new procs for the same slots
            raise ArbiterError(f"handoff {source} -> {target}: on (host, slot)s {other_procs} "
                               "they live in different processes (a handoff copies within "
                               "one); sync through shared memory (services.sync_weights does "
                               "for replicas on other procs)")

    async def _hand_off(self, source: str, target: str, keep: list[str] | None,
                        first: list[str] | None) -> int:
        """One handoff through the arbiters of `target`'s hosts."""
        copied = 0

        async def on(host: int, slots: list[int]) -> HostView:
            nonlocal copied
            moved, view = await self.arbiter(host).handoff.call_one(
                source, target, slots, keep, first)
            copied += moved
            return view

        touched = self._neighbours(target) | {source}
        if self.measures:
            touched.add(target)  # its stages beyond the weights may sleep to make room
        await self._switch(
            touched, lambda: {h: on(h, slots) for h, slots in self._by_host(target).items()})
        return copied

    async def _copy_in_place(self, source: str, targets: list[str]) -> dict[str, int]:
        """The `targets` take `source`'s weights in their procs, with no switch: all are
        marked switching (routing to them waits), their calls in flight drained, and
        switches of any wait for the copies (`InPlaceCopies`); all watched together
        as the arbiter watches a plan (`copy_in_place`)."""
        touched = {source, *targets}
        self._switching.update(touched)
        try:
            async with self.copies.running_on(touched):
                await self._under_way.run(self._drain(touched, copies=False))
                return await self._under_way.run(copy_in_place(
                    source, {t: self.actors[t] for t in targets},
                    lambda: self._find_lost(touched),
                    lambda: self.kill(sorted({(host, pid) for (host, _), pid in
                                              self.pids[source].items()})),
                    self.config.call_timeout_s, DRAIN_LIVENESS_S))
        finally:
            self._switching.subtract(touched)
            self._changed()


class InPlaceCopies:
    """The in-place copies under way, counted per tenant (source and target)."""

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


async def copy_in_place(source: str, targets: dict[str, Any],
                        find_lost: Callable[[], Awaitable[dict[str, str]]],
                        kill: Callable[[], Awaitable[None]], timeout_s: float,
                        poll_s: float) -> dict[str, int]:
    """Have every proc of each target's actor mesh (`targets`: name -> mesh) take tenant
    `source`'s weights from its own process (`TenantActor.receive`: all at once, as a
    sharded source's gathers need); returns the bytes copied per target once all have
    ended. Watched as the arbiter watches a plan: every `poll_s` the tenants' procs are
    checked (`find_lost`: a rank that died would leave the others in their gathers); a
    tenant found lost so, or whose actor failed the call, raises `TenantLostError`, and so
    do copies not done within `timeout_s`, the procs taken for hung and killed first
    (`kill`)."""
    async def call(actors: Any) -> int:
        async with remote_errors():
            copied = await actors.receive.call(source)
        return sum(nbytes for _, nbytes in copied.items())

    names = ", ".join(targets)
    copies = asyncio.ensure_future(asyncio.gather(
        *(call(actors) for actors in targets.values()), return_exceptions=True))
    deadline = time.monotonic() + timeout_s
    try:
        while not copies.done():
            await asyncio.wait({copies},
                               timeout=min(poll_s, max(0.0, deadline - time.monotonic())))
            if not copies.done() and (lost := await find_lost()):
                raise _lost(source, names, lost)
            if not copies.done() and time.monotonic() >= deadline:
                await kill()
                raise _lost(source, names, {name: f"its procs did not answer within "
                                                  f"{timeout_s} s (hung) and were killed"
                                            for name in targets})
        results = dict(zip(targets, copies.result(), strict=True))
        failed = {name: r for name, r in results.items() if isinstance(r, BaseException)}
        if not failed:
            return results  # type: ignore[return-value]
        name, err = next(iter(failed.items()))
        if lost := await find_lost():
            raise _lost(source, names, lost) from err
        if isinstance(err, SupervisionError):  # gone before its arbiter could look
            why = (str(err).strip().splitlines() or ["its actor failed"])[-1].strip()
            raise _lost(source, names, {name: why}) from err
        raise err
    finally:
        copies.cancel()


def _lost(source: str, targets: str, lost: dict[str, str]) -> TenantLostError:
    return TenantLostError(f"handoff {source} -> {targets} in place: " + "; ".join(
        f"{name} lost ({why})" for name, why in lost.items()), None, tuple(lost))


def _each(targets: Sequence[str], results: list[int | BaseException]) -> dict[str, int]:
    """Bytes copied per target, or the first failure (each failed handoff rolled its slots
    back; the others are done)."""
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return dict(zip(targets, results, strict=True))  # type: ignore[arg-type]
