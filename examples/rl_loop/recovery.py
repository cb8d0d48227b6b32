"""Going on after a lost proc: the run's own part of a group restart.

When a slot proc dies, the runtime restarts the trainer's resource group
(`ServiceConfig(restart="group")`, `services.restart`): every proc of the group replaced,
the trainer and the generator spawned again on them in their spawn order, so they share a
process again. This module does what only the loop can do around that:

1. the restart's hook cancels the step under way, before its held calls could reach the
   new generation (they would train the restored trainer on a stale batch);
2. once the group is back, the trainer loads the newest complete checkpoint (none yet: it
   keeps the weights it started with), the generator gets them, and the loop's state goes
   back to that checkpoint's;
3. the restart is recorded (step, cause, seconds lost, steps redone), and the loop goes on
   from the checkpoint's step. Because a resumed run is the same run, the steps redone give
   the metrics they gave before.

A failure with no restart behind it (an endpoint's own error), a restart that failed, or
more than `run.max_restarts` restarts end the run with the cause.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, Protocol

from examples.rl_loop.config import RLConfig
from examples.rl_loop.record import RunRecord
from examples.rl_loop.rollouts import Rollouts
from examples.rl_loop.saves import Saves
from examples.rl_loop.state import LoopState, identity
from services import RestartEvent
from services.restart import GroupRestarts

logger = logging.getLogger(__name__)
RESTART_SEEN_S = 3.0  # a failed step waits this long for its group's restart to begin


class Recovering(Protocol):
    """What the recovery uses of the loop (`loop.Loop`)."""

    cfg: RLConfig
    record: RunRecord
    saves: Saves
    sampler: Any  # the task's prompt sampler: state_dict() / load_state_dict()
    sampler_start: dict[str, Any]  # its state before any step
    rollouts: Rollouts

    async def load(self, checkpoint: Path | None) -> None: ...


class Recovery:
    """The loop's side of its trainer group's restarts, once it `follow`s them."""

    restarts: GroupRestarts

    def __init__(self, loop: Recovering) -> None:
        self.loop = loop
        self.stepping: asyncio.Future | None = None  # the step under way
        self.events = 0  # restarts seen when the step under way began

    def follow(self, restarts: GroupRestarts) -> None:
        """Go on after each of `restarts` (the trainer's group's, followed before its
        services are spawned): a restart first abandons the step under way."""
        self.restarts = restarts
        restarts.on_restart.append(self._abandon_step)

    async def run(self, step: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
        """Run one step, which a restart of the group may cancel."""
        self.events = len(self.restarts.events)
        self.stepping = asyncio.ensure_future(step)
        try:
            return await self.stepping
        finally:
            self.stepping = None

    async def _abandon_step(self, event: RestartEvent) -> None:
        if self.stepping is not None:
            self.stepping.cancel()

    async def recover(self, index: int, failure: BaseException, again: int = 0) -> int:
        """Step `index` failed: when the trainer's group restarted for it, reload the newest
        complete checkpoint (none yet: the start) and return the step to go on from;
        otherwise raise the failure. A proc lost during the reload itself (`again`: how
        often so far) restarts the group once more, counted against run.max_restarts."""
        event = await self._restart_for(failure)
        self.events = len(self.restarts.events)  # a later restart is a new one
        loop, run = self.loop, self.loop.cfg.run
        record = loop.record
        if len(record.restarts) + again >= run.max_restarts:
            raise RuntimeError(f"a proc of the run was lost again after {run.max_restarts} "
                               f"restart(s) (run.max_restarts): {event.cause}") from failure
        found = loop.saves.checkpoints.complete()
        path = found[-1] if found else None
        state = LoopState.read(path / "loop.json") if path else LoopState(
            step=0, sampler=loop.sampler_start,
            identity=identity(record.config), metrics=record.steps[:1])
        loading = time.monotonic()
        try:
            await loop.load(path)
        except Exception as lost:  # its new procs were lost too: their group restarts again
            return await self.recover(index, lost, again + 1)
        redone = record.steps[len(state.metrics):]
        loop.sampler.load_state_dict(state.sampler)
        loop.rollouts.load_state_dict(state.carried)
        record.rewind(state)
        record.restart({
            "step": index, "resumed_at": state.step, "steps_redone": index - state.step,
            "cause": event.cause, "restart_s": event.seconds,
            "load_and_sync_s": time.monotonic() - loading,
            "seconds_lost": time.time() - event.detected_at
            + sum(row["step_s"] for row in redone)})
        logger.warning("restart %d: going on from step %d (%d step(s) to redo) after: %s",
                       len(record.restarts), state.step, index - state.step, event.cause)
        return state.step

    async def _restart_for(self, failure: BaseException) -> RestartEvent:
        """The restart of the trainer's group that `failure` came with, once it has ended;
        `failure` itself when none began within the proc watch's detection time."""
        deadline = time.monotonic() + RESTART_SEEN_S
        while not self.restarts.running and len(self.restarts.events) == self.events:
            if isinstance(failure, asyncio.CancelledError) or time.monotonic() > deadline:
                raise failure
            await asyncio.sleep(0.05)
        if self.restarts.running:
            await asyncio.shield(self.restarts.task)
        event = self.restarts.events[-1]
        if event.error is not None:
            raise RuntimeError(f"the run's slots did not come back after a lost proc: "
                               f"{event.error}") from failure
        return event
