"""The always-on watch of the procs that run spawned actors, both sides of it: which of a
host's pids died (the arbiter's side), and the long polls that report them (the client's).

A call in flight in a proc that dies while no switch runs would otherwise end only when
Monarch's supervision gives up on the proc (about 7 s). Each host's arbiter keeps a
`PidWatch` of the procs the runtime spawned actors on, and polls their pids on its own
host, so this works for remote hosts too, where the client cannot see the pids. The
client's `ProcWatchClient` sends each host its set when it changed (`watch`: a
fire-and-forget message, versioned so that the newest wins), and one task per host
long-polls it (`next_dead`): the call returns as soon as a watched pid stops running
(checked every `POLL_S`), or empty after `WINDOW_S`, so the client asks again and nothing
waits on a runtime that went away; what died goes to `on_dead(host, pids)`. A poll that
fails (the arbiter's process is gone, and with it its host) goes to `on_lost(host, why)`,
as does a host whose worker no longer takes connections (`answers(host)`, asked every
`PROBE_S` where the hosts' job can tell). Idle, it costs each arbiter a pid check every
`POLL_S` and one message per host every `WINDOW_S`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from colocate import telemetry

POLL_S = 0.1  # how often the watched pids are checked: a dead proc is reported within this
WINDOW_S = 5.0  # the longest a poll waits before it is asked again
PROBE_S = 1.0  # how often each host's worker is asked for a connection, where it can be
CLOSE_S = 2.0  # at stop: how long the arbiters get to answer the polls under way
logger = logging.getLogger(__name__)


class PidWatch:
    """The arbiter's side: a set of pids (set whole, the newest version wins) and the
    long poll over it."""

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


class ProcWatchClient:
    """The client's side: one long-poll task per host over its arbiter's `PidWatch`."""

    def __init__(self, arbiter: Callable[[int], Any], hosts: int,
                 on_dead: Callable[[int, list[int]], None],
                 on_lost: Callable[[int, str], None] | None = None,
                 answers: Callable[[int], bool | None] | None = None) -> None:
        self.arbiter, self.hosts, self.on_dead, self.on_lost = arbiter, hosts, on_dead, on_lost
        self.answers = answers
        self.version = 0
        self.sent: dict[int, set[int]] = {}  # host -> the pids it watches
        self.closed = False
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._poll(host)) for host in range(self.hosts)]
        if self.answers is not None and self.on_lost is not None:
            self._tasks.append(asyncio.ensure_future(self._probe(self.answers, self.on_lost)))

    async def _probe(self, answers: Callable[[int], bool | None],
                     on_lost: Callable[[int, str], None]) -> None:
        """Every `PROBE_S`, whether each host's worker still takes connections: a worker
        gone while its procs live on (they outlive it for a while) is a lost host too."""
        left = set(range(self.hosts))
        while not self.closed and left:
            for host in sorted(left):
                found = await asyncio.to_thread(answers, host)
                if found is None:  # the job cannot tell
                    return
                if not found and not self.closed:
                    left.discard(host)
                    on_lost(host, "its worker stopped taking connections")
            await asyncio.sleep(PROBE_S)

    def watch(self, pids: dict[int, set[int]]) -> None:
        """Watch exactly `pids` (host -> pids) from now on; hosts whose set is unchanged
        get no message."""
        if self.closed:
            return
        for host in range(self.hosts):
            now = pids.get(host, set())
            if now != self.sent.get(host, set()):
                self.version += 1
                self.sent[host] = set(now)
                self.arbiter(host).watch_pids.broadcast(self.version, sorted(now))

    async def _poll(self, host: int) -> None:
        while not self.closed:
            try:
                dead = await self.arbiter(host).next_dead.call_one(WINDOW_S)
            except Exception as err:  # the arbiter is gone: its host, unless we stop
                if not self.closed:
                    why = str(err).splitlines()[0] if str(err) else type(err).__name__
                    logger.warning("the proc watch of host %d stopped: %s", host, why)
                    if self.on_lost is not None:
                        self.on_lost(host, f"its arbiter stopped answering "
                                           f"({type(err).__name__})")
                return
            if dead and not self.closed:
                self.sent.get(host, set()).difference_update(dead)  # the arbiter dropped them
                self.on_dead(host, dead)

    async def stop(self) -> None:
        """End the polls (the arbiters answer those under way at once), then the tasks."""
        if self.closed:
            return
        self.closed = True
        try:
            await asyncio.wait_for(asyncio.gather(*(
                self.arbiter(host).close_watch.call_one() for host in range(self.hosts))),
                CLOSE_S)
        except Exception as err:
            logger.debug("closing the proc watch: %s", err)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
