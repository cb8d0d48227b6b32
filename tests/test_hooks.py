"""The run's hooks: each moment of a run calls its hook, in order, and what a hook wraps
(the save, the sync) runs through it; bench/chaos.py injects its faults through these
hooks alone, so a renamed hook fails here rather than silently firing no fault."""

from __future__ import annotations

import inspect

import pytest

from bench.chaos import make_chaos
from examples.rl_loop.config import load_config
from examples.rl_loop.hooks import PHASES, Hooks
from examples.rl_loop.loop import Loop

pytestmark = pytest.mark.timeout(300)


class Recording(Hooks):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def started(self) -> None:
        self.calls.append(("started",))

    async def step_began(self, index: int) -> None:
        self.calls.append(("step_began", index))

    async def phase(self, label: str) -> None:
        self.calls.append(("phase", label))

    async def save(self, done, save):
        notes = await save()
        self.calls.append(("save", done, self.loop.saves.checkpoints.path(done).exists()))
        return notes

    async def sync(self, sync) -> None:
        self.calls.append(("sync", self.loop.rollouts.synced.__qualname__))
        await sync()

    async def step_ended(self, index: int, row: dict) -> None:
        self.calls.append(("step_ended", index, row["step"]))

    async def stopping(self) -> None:
        self.calls.append(("stopping",))


async def test_every_moment_of_a_run_calls_its_hook_in_order(tmp_path):
    cfg = load_config(overrides=["run.steps=2", "run.eval_every=2", "run.save_every=2",
                                 f"run.out={tmp_path}"])
    hooks = Recording()
    await Loop(cfg, hooks=hooks).run()
    step = [("phase", "generate"), ("phase", "train")]
    assert hooks.calls == [
        ("started",), ("phase", "start"),
        ("step_began", 0), *step, ("save", 1, False), ("sync", "Rollouts.synced"),
        ("phase", "sync"), ("step_ended", 0, 0),
        ("step_began", 1), *step, ("save", 2, True), ("sync", "Rollouts.synced"),
        ("phase", "sync"), ("step_ended", 1, 1),
        ("stopping",)]
    assert {label for call in hooks.calls if call[0] == "phase" for label in call[1:]} \
        <= set(PHASES)


def test_the_chaos_bench_overrides_only_hooks_the_loop_calls(tmp_path):
    chaos = make_chaos(load_config(overrides=[f"run.out={tmp_path}"]), [])
    hooks = {name for name, f in vars(Hooks).items() if inspect.iscoroutinefunction(f)}
    overridden = {name for name, f in vars(type(chaos)).items()
                  if inspect.iscoroutinefunction(f) and not name.startswith("_")}
    assert {"started", "step_began", "phase", "save", "sync", "step_ended", "loading",
            "stopping"} <= overridden
    # its own coroutines besides the hooks: none but the restart callback it registers
    assert overridden - hooks == {"in_restart"}
    assert chaos.loop.hooks is chaos
