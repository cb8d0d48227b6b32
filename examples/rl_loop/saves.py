"""The run's checkpoints as it goes: when it saves (`run.save_every`, and at the end), the
trainer's checkpoint started while it is awake after its step, the model exported when
`run.export_every` says so, the loop's state added once the step's metrics are in (then the
old checkpoints pruned), and the checkpoint a run goes on from (`run.resume`). The files
themselves are `state.py`'s.

A checkpoint's write runs in the background; the steps after it ask whether it ended. One
that failed (a full disk, one rank's write refused) left nothing under its directory, and
is found at the next step, not the next save: the loop logs it, notes it in that step's row
(`checkpoint_rewritten`) and saves again at once, so a later fault redoes at most
`run.save_every` steps. A save that fails again stops the run, naming the cause.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from colocate.engines.checkpoint import WRITING, CheckpointWriteError
from examples.rl_loop.config import RLConfig, as_dict
from examples.rl_loop.record import RunRecord
from examples.rl_loop.rollouts import Rollouts
from examples.rl_loop.state import Checkpoints, LoopState, find_resume, identity
from services import Service

logger = logging.getLogger(__name__)


class Saves:
    """The run's checkpoints under `out`/checkpoints: the trainer's (through `trainer()`,
    the service of the run's current start) and the loop's (its record, its prompt
    sampler's position and its rollouts under way)."""

    def __init__(self, cfg: RLConfig, out: Path, record: RunRecord, sampler: Any,
                 rollouts: Rollouts, trainer: Callable[[], Service]) -> None:
        self.cfg, self.out, self.record = cfg, out, record
        self.sampler, self.rollouts, self.trainer_of = sampler, rollouts, trainer
        self.checkpoints = Checkpoints(out / "checkpoints", cfg.run.keep_last)
        self.waits = False  # the trainer's saves: staged, then written in the background
        self.writing: int | None = None  # the step whose checkpoint is being written
        self.rewritten: int | None = None  # saved again: the last save's write failed
        self.write_failures: list[dict[str, Any]] = []  # step, found_at, detected_at, cause

    @property
    def trainer(self) -> Service:
        return self.trainer_of()

    def due(self, done: int) -> bool:
        """Whether the loop keeps a checkpoint after `done` steps."""
        every = self.cfg.run.save_every
        return every > 0 and (done % every == 0 or done == self.cfg.run.steps
                              or done == self.rewritten)

    async def after_step(self, done: int) -> dict[str, Any]:
        """While the trainer is awake after its `done`-th step: find whether the last
        save's write failed (then save again now), start its checkpoint when due (the
        loop's state joins it once the step's metrics are in) and export the model when
        `run.export_every` says so. Returns what the step's row notes of it."""
        notes = {}
        if failed := await self._write_failed(done):
            self.rewritten = done
            notes["checkpoint_rewritten"] = failed
        if self.due(done):
            path = self.checkpoints.path(done)
            shutil.rmtree(path, ignore_errors=True)  # what a killed run left half-written
            path.mkdir(parents=True)
            await self.trainer.save_checkpoint.route(str(path / "trainer"),
                                                     wait=self.waits or bool(failed))
            self.writing = None if self.waits or failed else done
        every = self.cfg.run.export_every
        if every and done % every == 0:
            await self.trainer.export_model.route(str(self.out / "model"))
        return notes

    async def at_end(self, done: int) -> None:
        """At the end, the trainer awake after its `done`-th step: the last save's write
        waited for; one that failed is saved again, waited for (a second failure stops the
        run, naming it)."""
        if await self._write_failed(done, wait=True):
            self.rewritten = done
            await self.after_step(done)  # the step's directory anew: its loop state goes too
            await self.trainer.wait_checkpoint.route()
            self.write_loop_state(done)

    async def _write_failed(self, done: int, wait: bool = False) -> dict[str, Any] | None:
        """The write of the checkpoint being written, if it ended (with `wait`: once it
        ends) and failed (found after step `done`): logged and kept in `write_failures`."""
        if self.writing is None or not wait and \
                await self.trainer.poll_checkpoint.route() == WRITING:
            return None
        step, self.writing = self.writing, None
        try:
            await self.trainer.wait_checkpoint.route()
            return None
        except CheckpointWriteError as err:
            cause = str(err).splitlines()[0] if str(err) else type(err).__name__
            logger.warning("the checkpoint of step %d was not written (%s): saving step %d "
                           "now instead", step, cause, done)
            failure = {"step": step, "found_at": done, "cause": cause}
            self.write_failures.append({**failure, "detected_at": time.time()})
            return failure

    def write_loop_state(self, done: int) -> None:
        """The loop's side of the checkpoint after `done` steps, then the old ones pruned."""
        if not self.due(done):
            return
        LoopState(step=done, sampler=self.sampler.state_dict(),
                  identity=identity(self.record.config), metrics=self.record.steps,
                  memory=self.record.memory, phases=self.record.phases,
                  restarts=self.record.restarts, elapsed_s=self.record.now(),
                  carried=self.rollouts.state_dict(),
                  ).write(self.checkpoints.path(done) / "loop.json")
        self.checkpoints.prune()

    def resume(self) -> tuple[Path, LoopState] | None:
        """The checkpoint to go on from (`run.resume`), its loop state restored here."""
        found = find_resume(self.cfg.run.resume, self.checkpoints, self.record.config,
                            as_dict(RLConfig()))
        if found is None:
            if self.cfg.run.resume == "none" and (removed := self.checkpoints.clear()):
                logger.warning("run.resume=none: removed %d checkpoint(s) of an earlier run "
                               "under %s", removed, self.checkpoints.root)
            return None
        path, state = found
        self.sampler.load_state_dict(state.sampler)
        self.rollouts.load_state_dict(state.carried)
        self.record.resume(state)
        return path, state
