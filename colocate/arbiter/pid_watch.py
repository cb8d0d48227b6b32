"""The always-on watch of one host's slot procs: which of the pids it was given died.

A call in flight in a proc that dies while no switch runs would otherwise end only when
Monarch's supervision gives up on the proc (about 7 s). Each host's arbiter keeps a
`PidWatch` of the procs the runtime spawned actors on (`watch`: the client sends the set
whenever it changes), and the client long-polls it (`next_dead`): the call returns as soon
as a watched pid stops running (checked every `POLL_S`), or empty after `timeout_s`, so
the client asks again and nothing waits on a runtime that went away. Free of Monarch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

from colocate import telemetry

POLL_S = 0.1  # how often the watched pids are checked: a dead proc is reported within this


class PidWatch:
    """A set of pids (set whole, the newest version wins) and the long poll over it."""

    def __init__(self) -> None:
        self.version = -1
        self.pids: set[int] = set()
        self.closed = False

    def watch(self, version: int, pids: Iterable[int]) -> None:
        """Watch exactly `pids` from now on, unless a newer version was set already (the
        client's messages may arrive out of order)."""
        if version > self.version:
            self.version, self.pids = version, set(pids)

    def close(self) -> None:
        """Answer every poll now, and every later one at once (the runtime is stopping)."""
        self.closed = True
        self.pids = set()

    def dead(self) -> list[int]:
        """The watched pids that no longer run, dropped from the watch (each is told once)."""
        gone = sorted(pid for pid in self.pids if not telemetry.process_runs(pid))
        self.pids.difference_update(gone)
        return gone

    async def next_dead(self, timeout_s: float, poll_s: float = POLL_S) -> list[int]:
        """The watched pids that died, as soon as one has; [] after `timeout_s` or at close."""
        deadline = time.monotonic() + timeout_s
        while not self.closed:
            gone = self.dead()
            if gone or time.monotonic() >= deadline:
                return gone
            await asyncio.sleep(poll_s)
        return []
