"""What a client of the runtime (a service) hears: one `Listener`, given to `rm.listen`.

The resource manager hands the same listener to each part that speaks to it: the
`Switchboard` calls `drain` and `changed`, `Faults` calls `failed`, the manager itself
calls `close`. A client gives only what it needs; the rest do nothing. (The procs
themselves are watched elsewhere: `colocate.arbiter.proc_watch`.)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass


async def _drained(tenants: set[str]) -> None:
    return None


def _unchanged() -> None:
    return None


def _not_failed(name: str, why: str) -> None:
    return None


async def _closed(grace_s: float) -> None:
    return None


@dataclass(frozen=True)
class Listener:
    """- `drain(tenants)`: before a switch that may put `tenants` to sleep (routing to them
      has stopped); return when their calls in flight are done.
    - `changed()`: after the view of who is awake changed or a switch ended (any thread).
    - `failed(name, why)`: a spawn's mesh failed or an arbiter found its proc dead (on
      Monarch's thread, or the loop's: record and schedule only).
    - `close(grace_s)`: the runtime shuts down: take no new calls, end the waiting ones,
      give those in flight `grace_s` to finish, then end them with an error; return when
      every call has ended."""

    drain: Callable[[set[str]], Awaitable[None]] = _drained
    changed: Callable[[], None] = _unchanged
    failed: Callable[[str, str], None] = _not_failed
    close: Callable[[float], Awaitable[None]] = _closed
