"""Awaiting a call whose procs may die or hang while it waits.

A call in flight in a proc that died holds its caller until Monarch gives up on the proc
(seconds to minutes), and one in a proc that hangs holds it for ever. So the runtime's
waits on other procs (the arbiter's call to a tenant's proc, the drain of calls in flight
before a switch, an in-place copy between tenants' procs) await the call while checking,
every so often, that the procs it waits on still run, and, where they have one, enforce a
deadline. `watched` is that loop; the caller's check decides what a lost proc means
(raise, or report and go on waiting), and its `late` what a missed deadline does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def watched(call: Awaitable[T], poll_s: float, check: Callable[[], Awaitable[None]],
                  timeout_s: float | None = None,
                  late: Callable[[], Awaitable[BaseException]] | None = None,
                  check_first: bool = False) -> T:
    """`call`'s answer. While it is pending, `check()` runs every `poll_s` (and before the
    first wait, with `check_first`); it raises to end the wait. With `timeout_s`, a call not
    done by then raises `late()`'s error (it may first kill what hung; without `late`, a
`TimeoutError`). A wait that ends
    without the answer cancels the call."""
    task = asyncio.ensure_future(call)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        if check_first:
            await check()
        while not task.done():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            await asyncio.wait({task}, timeout=poll_s if left is None else min(poll_s, left))
            if task.done():
                break
            await check()
            if deadline is not None and not task.done() and time.monotonic() >= deadline:
                raise TimeoutError(f"no answer within {timeout_s} s") if late is None \
                    else await late()
        return task.result()
    finally:
        if not task.done():
            task.cancel()
