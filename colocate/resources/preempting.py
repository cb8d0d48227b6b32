"""How a switch with preemption asks the tenants it may put to sleep to stop their running
`@preemptible` calls early: through each one's `Preempter` actors (see
`colocate.arbiter.preempt`), waiting at most `ArbiterConfig.preempt_timeout_s`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from colocate.arbiter.errors import PreemptTimeoutError
from colocate.arbiter.preempt import LATE, UNSUPPORTED

PREEMPT_MESSAGE_S = 10.0  # beyond the preempt bound: how long its message may take
logger = logging.getLogger(__name__)


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
