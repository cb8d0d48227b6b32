"""Weights copied in place with no switch. On slots where the arbiters have nothing to
decide (every tenant wholly awake, every declared working memory fits: `room.roomy`), a
handoff is the copy alone, so the switchboard asks the target's procs for it directly: one
message a proc instead of client -> arbiter -> proc (2-4 ms of a 0.1 s RL step on CPU,
bench/RESULTS.md). `InPlaceCopies` keeps the other switches of the two tenants waiting
until the copy is done, as the arbiter's slot lock does for the switches it runs."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextlib import asynccontextmanager
from typing import Any

from colocate.arbiter.actor import remote_errors
from colocate.arbiter.errors import TenantLostError
from colocate.monarch_compat import SupervisionError


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


async def copy_in_place(target_actors: Any, source: str, target: str,
                        find_lost: Callable[[], Awaitable[dict[str, str]]],
                        kill: Callable[[], Awaitable[None]], timeout_s: float,
                        poll_s: float) -> int:
    """Have every proc of `target`'s actor mesh take tenant `source`'s weights from its own
    process (`TenantActor.receive`: all at once, as a sharded source's gathers need);
    returns the bytes copied. As the arbiter watches its plans: every `poll_s` the two
    tenants' procs are checked (`find_lost`: a rank that died would leave the others in
    their gathers); a tenant found lost so, or whose actor failed the call, raises
    `TenantLostError`, and so does a copy not done within `timeout_s`, its procs taken for
    hung and killed first (`kill`)."""
    async def call() -> Any:
        async with remote_errors():
            return await target_actors.receive.call(source)

    copy = asyncio.ensure_future(call())
    deadline = time.monotonic() + timeout_s
    try:
        while not copy.done():
            await asyncio.wait({copy}, timeout=min(poll_s, max(0.0, deadline - time.monotonic())))
            if not copy.done() and (lost := await find_lost()):
                raise _lost(source, target, lost)
            if not copy.done() and time.monotonic() >= deadline:
                await kill()
                raise _lost(source, target, {target: f"its procs did not answer within "
                                                     f"{timeout_s} s (hung) and were killed"})
        try:
            return sum(nbytes for _, nbytes in copy.result().items())
        except Exception as err:
            lost = await find_lost()
            if lost:
                raise _lost(source, target, lost) from err
            if isinstance(err, SupervisionError):  # gone before its arbiter could look
                why = (str(err).strip().splitlines() or ["its actor failed"])[-1].strip()
                raise _lost(source, target, {target: why}) from err
            raise
    finally:
        copy.cancel()


def _lost(source: str, target: str, lost: dict[str, str]) -> TenantLostError:
    return TenantLostError(f"handoff {source} -> {target} in place: " + "; ".join(
        f"{name} lost ({why})" for name, why in lost.items()), None, tuple(lost))
