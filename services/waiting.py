"""`Changes`: an asyncio condition over a service's state that any thread may signal and
coroutines on any event loop may wait on.

A service waits for an awake replica and for its calls in flight to finish. What ends
those waits happens on several threads: a switch ends on the loop that ran it (the
client's, or the helper loop of the blocking `phase`), a call ends on the loop that made
it, and Monarch reports a dead proc on its own thread. `asyncio.Condition` belongs to one
loop, so a service keeps a change counter instead: each change bumps it and wakes every
waiter on its own loop. A waiter reads `version` before it looks at the state and then
waits for a version past it, so no change between the look and the wait is lost.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable


class Changes:
    """A change counter to wait on: `notify()` from anywhere, `await wait(since, ...)` on
    any loop, or `await wait_for(predicate, ...)`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._version = 0
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    @property
    def version(self) -> int:
        """How many changes there were: read it before looking at the state."""
        return self._version

    def notify(self) -> None:
        """Something changed: wake every waiter, on its own loop."""
        with self._lock:
            self._version += 1
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_wake, future)
            except RuntimeError:  # its loop is closed: nobody waits there any more
                pass

    async def wait(self, since: int, timeout: float | None) -> bool:
        """Wait until there were changes after version `since` (at once if there were), at
        most `timeout` seconds (None: no limit). True if there were."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self._version != since:
                return True
            self._waiters.append((loop, future))
        try:
            # not asyncio.wait_for: on Python 3.11 it swallows a cancellation that meets a
            # notify in the same loop iteration and returns the result (CPython
            # gh-86296, fixed in 3.12), so a cancelled waiter would go on waiting
            async with asyncio.timeout(timeout):
                await future
        except TimeoutError:
            pass
        finally:
            with self._lock:
                if (loop, future) in self._waiters:
                    self._waiters.remove((loop, future))
        return self._version != since

    async def wait_for(self, predicate: Callable[[], bool], timeout: float | None) -> bool:
        """Wait until `predicate()` holds, checked after each change, at most `timeout`
        seconds (None: no limit). Returns its last value."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            since = self._version
            if predicate():
                return True
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return False
            await self.wait(since, left)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
