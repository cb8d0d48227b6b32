"""Recovery of a durable RL run: a slot proc killed at a random step, and what a save costs.

    .venv/bin/python -m bench.recovery [--steps 30] [--save-every 5] [--seed 0]
        [--sizes default wide] [--save-steps 12]

Per model size (`default`: the RL loop's defaults; `wide`: model.hidden_size=256
model.layers=4):

1. **A kill**: the loop on 1 slot (trainer and generator sharing its proc), the slot proc
   SIGKILLed as a random step (seeded) starts generating. Measured from the kill: detection
   (the proc watch seeing the death: `RestartEvent.detected_at`), the group's restart (new
   proc, both services spawned again: `RestartEvent.seconds`), the checkpoint load and the
   first sync, and the first step completed after it ("back to training"); the steps
   redone. The run must end with the metrics of the same run never killed (checked against
   a run without the kill, in the same invocation).
2. **What a save costs a step**: `--save-steps` steps saving at every step, the trainer's
   save asynchronous (staged in host memory, written in the background: what the loop
   does) and then synchronous (`wait=True`), side by side; the save's share of the step
   (`save_s`, the time the trainer phase waits for it) and the step time, medians.

Targets: detection <= 1 s; back to training <= 30 s at the default size on a CPU machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import announce

SIZES = {"default": [], "wide": ["model.hidden_size=256", "model.layers=4"]}
COMPARED = ("reward", "loss", "grad_norm", "eval_reward")


def make_loop(cfg: Any, kill_at: int | None = None, sync_saves: bool = False) -> Any:
    """A Loop that SIGKILLs its slot proc as step `kill_at` starts generating, notes the
    wall time each step ends, and (with `sync_saves`) waits for each save's write."""
    from examples.rl_loop.hooks import Hooks
    from examples.rl_loop.loop import Loop

    class BenchHooks(Hooks):
        def __init__(self) -> None:
            self.index, self.killed_at, self.ended = -1, 0.0, []

        async def step_began(self, index: int) -> None:
            self.index = index

        async def phase(self, label: str) -> None:
            if label == "generate" and index_is(self.index, kill_at) and not self.killed_at:
                info = await self.loop.generator.replicas[0].actors.describe.call_one()
                self.killed_at = time.time()
                os.kill(info.pid, signal.SIGKILL)

        async def step_ended(self, index: int, row: dict[str, Any]) -> None:
            self.ended.append((index, time.time()))

    loop = Loop(cfg, hooks=BenchHooks())
    loop.saves.waits = sync_saves
    return loop


def index_is(index: int, wanted: int | None) -> bool:
    return wanted is not None and index == wanted


def overrides(size: str, out: Path, steps: int, save_every: int) -> list[str]:
    return [*SIZES[size], f"run.out={out}", f"run.steps={steps}",
            f"run.save_every={save_every}", f"run.eval_every={steps}", "run.keep_last=2"]


def per_step(out: Path) -> list[tuple]:
    steps = json.loads((out / "metrics.json").read_text())["steps"]
    return [(s["step"], *(s.get(k) for k in COMPARED)) for s in steps]


async def kill_run(size: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """A run killed at a random step, and the same run never killed; the recovery's parts."""
    from examples.rl_loop.config import load_config

    rng = random.Random(f"{args.seed}-{size}")
    kill_at = rng.randrange(args.save_every + 1, args.steps - 1)
    plain = make_loop(load_config(overrides=overrides(size, tmp / f"{size}-plain",
                                                      args.steps, args.save_every)))
    await plain.run()
    killed = make_loop(load_config(overrides=overrides(size, tmp / f"{size}-killed",
                                                       args.steps, args.save_every)),
                       kill_at=kill_at)
    summary = await killed.run()
    [restart] = killed.record.restarts
    [event] = killed.recovery.restarts.events
    hooks = killed.hooks
    back = min(t for i, t in hooks.ended if t > hooks.killed_at)
    return {
        "size": size, "kill_at": kill_at, "restarts": summary["restarts"],
        "detect_s": event.detected_at - hooks.killed_at,
        "restart_s": event.seconds,
        "load_and_sync_s": restart["load_and_sync_s"],
        "back_to_training_s": back - hooks.killed_at,
        "steps_redone": restart["steps_redone"],
        "same_metrics": per_step(tmp / f"{size}-killed") == per_step(tmp / f"{size}-plain"),
    }


async def save_cost(size: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Median save_s and step_s with a save at every step, async then sync."""
    from examples.rl_loop.config import load_config

    found: dict[str, Any] = {"size": size}
    for mode in ("async", "sync"):
        out = tmp / f"{size}-save-{mode}"
        loop = make_loop(load_config(overrides=overrides(size, out, args.save_steps, 1)),
                         sync_saves=mode == "sync")
        await loop.run()
        rows = [s for s in loop.record.steps if s["step"] >= 1]  # the first warms up
        found[f"{mode}_save_s"] = statistics.median(r["save_s"] for r in rows)
        found[f"{mode}_step_s"] = statistics.median(r["step_s"] for r in rows)
    found["sync_over_async_save"] = found["sync_save_s"] / found["async_save_s"]
    return found


async def main(args: argparse.Namespace) -> None:
    info, command = announce()
    tmp = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    results: dict[str, Any] = {"machine": info, "command": command, "kills": [], "saves": []}
    try:
        for size in args.sizes:
            kill = await kill_run(size, args, tmp)
            results["kills"].append(kill)
            print(f"{size}: killed at step {kill['kill_at']}: detection "
                  f"{kill['detect_s']:.3f} s, restart {kill['restart_s']:.2f} s, load + sync "
                  f"{kill['load_and_sync_s']:.2f} s, back to training "
                  f"{kill['back_to_training_s']:.2f} s after the kill, "
                  f"{kill['steps_redone']} step(s) redone, same metrics as never killed: "
                  f"{kill['same_metrics']}")
            cost = await save_cost(size, args, tmp)
            results["saves"].append(cost)
            print(f"{size}: a save at every step: async save {cost['async_save_s']:.4f} s "
                  f"of a {cost['async_step_s']:.3f} s step; sync save "
                  f"{cost['sync_save_s']:.4f} s of a {cost['sync_step_s']:.3f} s step "
                  f"(sync / async: {cost['sync_over_async_save']:.2f})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for kill in results["kills"]:
        ok = kill["detect_s"] <= 1.0 and kill["same_metrics"] and (
            kill["size"] != "default" or kill["back_to_training_s"] <= 30)
        print(f"{kill['size']}: targets (detection <= 1 s; default size back <= 30 s; same "
              f"metrics): {'met' if ok else 'MISSED'}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--save-steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--json", help="also write the figures to this file")
    asyncio.run(main(parser.parse_args()))
