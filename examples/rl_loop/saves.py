"""What the run keeps as it goes: this module's one job is to say when the run saves
(`run.save_every`, and at the end), to start the trainer's checkpoint while it is awake
after its step and export the model when `run.export_every` says so, to add the loop's
state once the step's metrics are in (then prune the old checkpoints), and to find the
checkpoint a run goes on from (`run.resume`). The files themselves are `state.py`'s.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

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

    def _saves(self, done: int) -> bool:
        """Whether the loop keeps a checkpoint after `done` steps."""
        every = self.cfg.run.save_every
        return every > 0 and (done % every == 0 or done == self.cfg.run.steps)

    async def _keep(self, done: int) -> None:
        """While the trainer is awake after its `done`-th step: start its checkpoint (the
        loop's state joins it once the step's metrics are in) and export the model when
        `run.export_every` says so."""
        if self._saves(done):
            path = self.checkpoints.path(done)
            shutil.rmtree(path, ignore_errors=True)  # what a killed run left half-written
            path.mkdir(parents=True)
            await self.trainer.save_checkpoint.route(str(path / "trainer"),
                                                     wait=self.save_waits)
        every = self.cfg.run.export_every
        if every and done % every == 0:
            await self.trainer.export_model.route(str(self.out / "model"))

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
