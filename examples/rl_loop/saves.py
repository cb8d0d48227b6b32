"""What the run keeps as it goes: this module's one job is to say when the run saves
(`run.save_every`, and at the end), to start the trainer's checkpoint while it is awake
after its step and export the model when `run.export_every` says so, to add the loop's
state once the step's metrics are in (then prune the old checkpoints), and to find the
checkpoint a run goes on from (`run.resume`). The files themselves are `state.py`'s.

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
from pathlib import Path
from typing import Any

from colocate.engines.checkpoint import WRITING, CheckpointWriteError
from examples.rl_loop.config import RLConfig
from examples.rl_loop.record import RunRecord
from examples.rl_loop.state import Checkpoints, LoopState, find_resume, identity
from services import Service

logger = logging.getLogger(__name__)


class Saves:
    """The run's checkpoints, for a loop (`Loop`) with these attributes."""

    cfg: RLConfig
    out: Path
    checkpoints: Checkpoints
    record: RunRecord
    sampler: Any  # the task's prompt sampler: state_dict() / load_state_dict()
    trainer: Service
    pool: Any  # rollout.mode=partial: the carried samples (`partial.Pool`); None: sync
    save_waits = False  # the trainer's saves: staged, then written in the background
    writing: int | None = None  # the step whose checkpoint is being written, in the background
    rewritten: int | None = None  # the step saved again because the last save's write failed
    write_failures: list[dict[str, Any]]  # each: step, found_at (a step), detected_at, cause

    def _saves(self, done: int) -> bool:
        """Whether the loop keeps a checkpoint after `done` steps."""
        every = self.cfg.run.save_every
        return every > 0 and (done % every == 0 or done == self.cfg.run.steps
                              or done == self.rewritten)

    async def _keep(self, done: int) -> dict[str, Any]:
        """While the trainer is awake after its `done`-th step: find whether the last
        save's write failed (then save again now), start its checkpoint when due (the
        loop's state joins it once the step's metrics are in) and export the model when
        `run.export_every` says so. Returns what the step's row notes of it."""
        notes = {}
        if failed := await self._write_failed(done):
            self.rewritten = done
            notes["checkpoint_rewritten"] = failed
        if self._saves(done):
            path = self.checkpoints.path(done)
            shutil.rmtree(path, ignore_errors=True)  # what a killed run left half-written
            path.mkdir(parents=True)
            await self.trainer.save_checkpoint.route(str(path / "trainer"),
                                                     wait=self.save_waits or bool(failed))
            self.writing = None if self.save_waits or failed else done
        every = self.cfg.run.export_every
        if every and done % every == 0:
            await self.trainer.export_model.route(str(self.out / "model"))
        return notes

    async def _last_save(self, done: int) -> None:
        """At the end, the trainer awake after its `done`-th step: the last save's write
        waited for; one that failed is saved again, waited for (a second failure stops the
        run, naming it)."""
        if await self._write_failed(done, wait=True):
            self.rewritten = done
            await self._keep(done)  # the step's directory anew: its loop state goes too
            await self.trainer.wait_checkpoint.route()
            self._keep_loop_state(done)

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

    def _keep_loop_state(self, done: int) -> None:
        """The loop's side of the checkpoint after `done` steps, then the old ones pruned."""
        if not self._saves(done):
            return
        LoopState(step=done, sampler=self.sampler.state_dict(),
                  identity=identity(self.record.config), metrics=self.record.steps,
                  memory=self.record.memory, phases=self.record.phases,
                  restarts=self.record.restarts, elapsed_s=self.record.now(),
                  carried=None if self.pool is None else self.pool.state_dict(),
                  ).write(self.checkpoints.path(done) / "loop.json")
        self.checkpoints.prune()

    def _resume(self) -> tuple[Path, LoopState] | None:
        """The checkpoint to go on from (`run.resume`), its loop state restored here."""
        found = find_resume(self.cfg.run.resume, self.checkpoints, self.record.config)
        if found is None:
            if self.cfg.run.resume == "none" and (removed := self.checkpoints.clear()):
                logger.warning("run.resume=none: removed %d checkpoint(s) of an earlier run "
                               "under %s", removed, self.checkpoints.root)
            return None
        path, state = found
        self.sampler.load_state_dict(state.sampler)
        if self.pool is not None:
            self.pool.load_state_dict(state.carried)
        self.record.resume(state)
        return path, state
