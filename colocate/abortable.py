"""`Abortable`: a set of awaits that one call ends at once, from any thread, with an error.

A shutdown must end what is under way (calls in a replica's mailbox, switches waiting on
an arbiter) without waiting for Monarch to give up on procs it is stopping. Each such await
runs through `run`; `abort(make_error)` cancels every one still running, on its own event
loop, and each then raises `make_error()` in its caller (a fresh exception per caller).
Later `run`s raise it at once. A caller that is itself cancelled stays cancelled.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class Abortable:
    """Awaits run through `run` end with `make_error()` once `abort(make_error)` is called."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: set[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = set()
        self._make_error: Callable[[], BaseException] | None = None

    @property
    def aborted(self) -> bool:
        return self._make_error is not None

    async def run(self, awaitable: Awaitable[T]) -> T:
        """Await `awaitable`, or raise the abort's error if `abort` comes first."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._make_error is not None:
                if asyncio.iscoroutine(awaitable):
                    awaitable.close()  # never started: no "never awaited" warning
                raise self._make_error()
            future = asyncio.ensure_future(awaitable)
            self._running.add((loop, future))
        try:
            return await future
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._make_error is not None and future.cancelled() and not (
                    task is not None and task.cancelling()):
                raise self._make_error() from None
            raise
        finally:
            with self._lock:
                self._running.discard((loop, future))

    def abort(self, make_error: Callable[[], BaseException]) -> None:
        """End every await running through `run` (and every later one) with `make_error()`.
        Safe from any thread; a second abort keeps the first error."""
        with self._lock:
            if self._make_error is None:
                self._make_error = make_error
            running = list(self._running)
        for loop, future in running:
            try:
                loop.call_soon_threadsafe(future.cancel)
            except RuntimeError:  # its loop is closed: nothing waits there any more
                pass
