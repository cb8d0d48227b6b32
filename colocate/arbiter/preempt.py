"""Preemption: how a switch asks a tenant's running calls to return what they have, both
sides of it: the flag in the tenant's process, and the client's ask.

A tenant's endpoints run one at a time, each holding the tenant's busy lock, on its
actor's own thread (`colocate.arbiter.actor`). A `preempt` endpoint of the tenant itself
would therefore wait behind the very call it should stop. The signal goes around both:

- each tenant actor has a `Preemption` (a flag and a count of its running preemptible
  calls, an object of its process); its preemptible calls poll `asked()` (the torch
  generator before each decoding step) and return early once it is set;
- a small `Preempter` actor (`colocate.arbiter.actor`), spawned beside every tenant that
  declares a `@preemptible` endpoint, on the same procs. Actors on one proc share the
  process and its module globals, and each runs its sync endpoints on a thread of its
  own, so the preempter reaches the tenant (through the process's table of tenants) and
  calls its `preempt` hook, a plain method, while the tenant's call is still running.

The switchboard asks for it (`Preempters`) when a switch is made with `preempt=True`
(`phase(trainer, preempt=True)`): before draining a neighbour's calls it has the preempter
set the flag and wait, up to `ArbiterConfig.preempt_timeout_s`, for the running preemptible calls to
return; then it drains as ever (they are back already) and clears the flag before the
arbiters switch. A tenant whose hook says it cannot stop early drains as usual; one whose
calls outlive the bound fails the switch (`PreemptTimeoutError`) before anything moved.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from colocate.arbiter.errors import PreemptTimeoutError

HONOURED = "honoured"  # the running preemptible calls returned (or none ran)
UNSUPPORTED = "unsupported"  # the tenant's hook cannot stop its calls: they drain
LATE = "late"  # a preemptible call still ran when the bound ran out
PREEMPT_MESSAGE_S = 10.0  # beyond the preempt bound: how long its message may take
logger = logging.getLogger(__name__)


class Preemption:
    """A tenant's preempt flag and its running preemptible calls, shared by the threads of
    its process (the tenant's, its compute thread's, its preempter's).

    The flag stays set from `request()` until `clear()`: a preemptible call that starts
    meanwhile (it was already on its way when routing stopped) returns at once."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._asked = False
        self._running = 0

    def asked(self) -> bool:
        """Whether a switch asked the running calls to stop (poll it between steps)."""
        return self._asked

    def request(self) -> None:
        with self._changed:
            self._asked = True
            self._changed.notify_all()

    def clear(self) -> None:
        with self._changed:
            self._asked = False

    @property
    def running(self) -> int:
        """The preemptible calls running now."""
        return self._running

    @contextmanager
    def call(self) -> Iterator[None]:
        """Count a preemptible call while it runs."""
        ended = self.begin()
        try:
            yield
        finally:
            ended()

    def begin(self) -> Callable[[], None]:
        """Count a preemptible call from now until the function returned is called (once,
        from any thread): a call whose answer comes after its endpoint returned."""
        with self._changed:
            self._running += 1
        once = threading.Lock()

        def ended() -> None:
            if once.acquire(blocking=False):
                with self._changed:
                    self._running -= 1
                    self._changed.notify_all()

        return ended

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no preemptible call runs; False when one still runs after
        `timeout_s`."""
        with self._changed:
            return self._changed.wait_for(lambda: self._running == 0, timeout_s)


class Preempters:
    """The `Preempter` actors of the tenants with preemptible endpoints, by tenant name."""

    def __init__(self, bound_s: float) -> None:
        self.bound_s = bound_s
        self.actors: dict[str, Any] = {}
        self._said_unpreemptible: set[str] = set()  # logged once each

    async def ask(self, names: list[str], awake: Callable[[], list[str]]) -> None:
        """Ask each of `names` to have its running preemptible calls return what they
        have, and wait until they did. A tenant whose hook cannot stop its calls is said
        once in the log (its calls drain as any); one whose calls still run after the bound
        fails the switch (`PreemptTimeoutError`), naming it and who is `awake()`."""
        bound = self.bound_s

        async def one(name: str) -> set[str]:
            try:
                answers = await asyncio.wait_for(
                    self.actors[name].preempt.call(name, bound), bound + PREEMPT_MESSAGE_S)
            except TimeoutError:
                return {LATE}
            except Exception:  # its procs died: the drain finds them lost
                return set()
            return {answer for _, answer in answers.items()}

        found = dict(zip(names, await asyncio.gather(*(one(n) for n in names)), strict=True))
        for name, answers in found.items():
            if UNSUPPORTED in answers and name not in self._said_unpreemptible:
                self._said_unpreemptible.add(name)
                logger.warning("tenant %r was asked to preempt its calls but cannot stop them "
                               "early; they are drained (waited for) instead", name)
        late = [name for name, answers in found.items() if LATE in answers]
        if late:
            raise PreemptTimeoutError(
                f"tenant {late[0]!r} did not honour a preempt within {bound} s "
                f"(ArbiterConfig.preempt_timeout_s): its preemptible call still runs; the "
                f"switch did not happen, nothing moved, and its call goes on. "
                f"Awake now: {', '.join(awake()) or 'nothing'}"
                + (f" (also late: {', '.join(late[1:])})" if late[1:] else ""), late[0])

    async def end(self, names: list[str]) -> None:
        """Clear the preempt flags of `names`: their calls from now on run to their end (a
        tenant whose procs died is skipped)."""
        await asyncio.gather(*(asyncio.wait_for(self.actors[n].end_preempt.call(n),
                                                PREEMPT_MESSAGE_S)
                               for n in names if n in self.actors), return_exceptions=True)
