"""Chaos: faults injected into the RL loop at random moments, and how each one ended.

    .venv/bin/python -m bench.chaos [--faults 20] [--steps 200] [--save-every 10]
        [--seed 0] [--kinds KIND ...] [--out FILE]

Faults are drawn (seeded) from a menu and grouped by the run shape they need; per shape
the loop runs once unfaulted and once with its faults, each fault fired at a random
moment (the step drawn from the seed, a delay drawn into the phase it hits):

- `kill-generator`: SIGKILL of the slot proc (trainer and generator share it) while the
  generator generates; `kill-trainer-rank`: SIGKILL of one DDP rank's proc (run.slots=2)
  during the train step; `kill-reference`: SIGKILL during the reference's forward
  (grpo.beta > 0); `kill-vllm-rank`: SIGKILL of one vLLM rank's proc (run.engine=vllm,
  2 slots) during generation;
- `kill-during-save`: SIGKILL right after the trainer's checkpoint is staged (its write in
  the background); `kill-during-handoff`: SIGKILL during the trainer -> generator weight
  sync; `kill-during-restart`: a slot proc killed, then the new proc killed again during
  the group's restart (in its hooks, or while the loop reloads the checkpoint);
- `write-failure`: one rank's checkpoint write fails (its proc's RLIMIT_FSIZE lowered for
  the write: EFBIG, the "disk full" of one rank); the loop finds it after the next step
  and saves again there (`examples/rl_loop/saves.py`), and the run goes on;
- `past-max-restarts`: a kill once the run's restarts are at `run.max_restarts`: the run
  stops naming the cause, and `run.resume=auto` finishes it;
- `hang`: SIGSTOP of the slot proc while it generates; the run's calls bounded by
  `CALL_BOUND_S` (`run.call_timeout_s`, set small for that run): the call past
  it counts as a hung proc, killed and restarted as after a crash (the bench's own bound,
  `HANG_S` without a step, would kill it otherwise and say so).

Per fault: kind, moment (step, phase), detection time (the runtime's, from the signal),
time back to training (a step completed after it), steps redone, and how it ended:
`went on` (the run recovered by itself) or `stopped, resumed` (the run stopped with an
error, and a second run with run.resume=auto finished it). After each run: the procs of
the bench's process tree still alive and the /dev/shm files the run's procs left
(`leftovers`). A faulted run's per-step metrics must equal its unfaulted run's.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench.common import announce
from bench.recovery import COMPARED
from colocate.resources import zygote

SHAPES = {"one-slot": [], "two-slots": ["run.slots=2"], "reference": ["grpo.beta=0.1"],
          "vllm": ["run.engine=vllm", "run.slots=2"]}
SHAPE_OF = {"kill-generator": "one-slot", "kill-during-save": "one-slot",
            "kill-during-handoff": "one-slot", "kill-during-restart": "one-slot",
            "past-max-restarts": "one-slot", "hang": "one-slot",
            "kill-trainer-rank": "two-slots", "write-failure": "two-slots",
            "kill-reference": "reference", "kill-vllm-rank": "vllm"}
MENU = ("kill-generator", "kill-trainer-rank", "kill-reference", "kill-vllm-rank",
        "kill-during-save", "kill-during-handoff", "kill-during-restart", "write-failure",
        "past-max-restarts", "hang")
PHASE_OF = {"kill-generator": "generate", "kill-vllm-rank": "generate", "hang": "generate",
            "kill-during-restart": "generate", "past-max-restarts": "generate",
            "kill-trainer-rank": "train", "kill-reference": "reference"}
STOPS = ("past-max-restarts",)  # faults that end the run by design
HANG_S = 60.0  # the bench's bound on a run making no progress
CALL_BOUND_S = 5.0  # the services' call_timeout_s in a run with a hang (SIGSTOP)
MAX_RESTARTS = 1000  # the faulted runs' run.max_restarts (past-max-restarts lowers it)
SHM = Path("/dev/shm")


@dataclasses.dataclass
class Fault:
    """One planned fault and, once fired, what came of it."""

    kind: str
    shape: str
    step: int  # fired at the first moment of its kind at or after this step index
    delay_s: float  # into the phase it hits
    pick: float  # which rank, which restart moment (drawn with the rest)
    fired_at: float = 0.0
    at_step: int | None = None
    phase: str = ""
    pid: int | None = None
    detect_s: float | None = None
    back_s: float | None = None
    steps_redone: int | None = None
    outcome: str = ""
    error: str | None = None
    note: str = ""
    restarts_before: int = 0  # the run's restarts when it fired

    def record(self) -> dict[str, Any]:
        found = dataclasses.asdict(self)
        for key in ("delay_s", "pick", "fired_at", "restarts_before"):
            del found[key]
        return found


def plan(args: argparse.Namespace) -> dict[str, list[Fault]]:
    """`args.faults` faults, the kinds spread evenly over the menu, at seeded steps; by shape."""
    rng = random.Random(args.seed)
    kinds = [args.kinds[i % len(args.kinds)] for i in range(args.faults)]
    rng.shuffle(kinds)
    shapes: dict[str, list[Fault]] = {}
    for kind in kinds:
        shapes.setdefault(SHAPE_OF[kind], []).append(
            Fault(kind, SHAPE_OF[kind], 0, rng.uniform(0.0, 0.02), rng.random()))
    for faults in shapes.values():
        # faults fire in order, each once the previous one is behind (training back)
        steps = sorted(rng.sample(range(1, args.steps - 1), len(faults)))
        for fault, step in zip(faults, steps, strict=True):
            fault.step = step
    return shapes


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def make_chaos(cfg: Any, faults: list[Fault]) -> Any:
    """A run (`chaos.loop`) whose hooks fire `faults` in order, each at its moment."""
    from examples.rl_loop.hooks import Hooks
    from examples.rl_loop.loop import Loop

    class ChaosHooks(Hooks):
        def __init__(self) -> None:
            self.pending = list(faults)
            self.fired: list[Fault] = []  # awaiting training back
            self.index, self.phase_now, self.began = -1, "start", 0.0
            self.ended: list[tuple[int, float]] = []
            self.armed: Fault | None = None  # kill-during-restart: its second kill
            self.stopped: list[int] = []  # SIGSTOPped pids
            self.pids: set[int] = set()

        # -- where the faults fire ------------------------------------------------------

        def due(self, *kinds: str) -> Fault | None:
            if self.fired or self.armed or not self.pending:
                return None
            fault = self.pending[0]
            return fault if fault.kind in kinds and self.index >= fault.step else None

        def fire(self, fault: Fault, pid: int, sig: int = signal.SIGKILL,
                 phase: str | None = None) -> None:
            if fault in self.pending:
                self.pending.remove(fault)
            fault.fired_at, fault.at_step, fault.pid = time.time(), self.index, pid
            fault.phase = phase or self.phase_now
            self.pids.add(pid)
            if fault not in self.fired:  # kill-during-restart fires twice
                fault.restarts_before = len(self.loop.record.restarts)
                self.fired.append(fault)
            if sig == signal.SIGSTOP:
                self.stopped.append(pid)
            kill(pid, sig)

        def later(self, fault: Fault, pid: int, sig: int = signal.SIGKILL) -> None:
            self.pending.remove(fault)  # not due again while its delay runs
            asyncio.get_running_loop().call_later(fault.delay_s, self.fire, fault, pid, sig)

        def pid_of(self, service: Any, pick: float) -> int:
            pids = service.replicas[0].allocation.pids
            return pids[int(pick * len(pids))]

        def note_pids(self) -> None:
            for service in self.loop.runtime.services().values():
                for replica in service.replicas:
                    self.pids.update(replica.allocation.pids)
            self.pids.update(p.pid for p in psutil.Process().children(recursive=True))

        # -- the run's hooks --------------------------------------------------------------

        async def started(self) -> None:
            self.loop.recovery.restarts.on_restart.append(self.in_restart)
            self.note_pids()

        async def step_began(self, index: int) -> None:
            self.index, self.began = index, time.time()

        async def step_ended(self, index: int, row: dict[str, Any]) -> None:
            now = time.time()
            self.ended.append((index, now))
            # training is back: a step begun after the fault completed (a step under way
            # at the kill may still end) -- unless the fault is one that ends the run
            waiting = [f for f in self.fired if f.kind in STOPS or f.fired_at >= self.began]
            for fault in self.fired:
                if fault in waiting:
                    continue
                fault.back_s = now - fault.fired_at
                fault.outcome = "went on"
                fault.steps_redone = sum(r["steps_redone"] for r in
                                         self.loop.record.restarts[fault.restarts_before:])
            self.fired = waiting

        async def phase(self, label: str) -> None:
            self.phase_now = label
            if label == "generate":
                self.note_pids()
            if fault := self.due(*(k for k, p in PHASE_OF.items() if p == label)):
                runtime = self.loop.runtime
                service = {"generate": runtime.generator, "train": runtime.trainer,
                           "reference": runtime.reference}[label]
                pid = self.pid_of(service, fault.pick)
                if fault.kind == "past-max-restarts":  # the restarts are at the limit now
                    cfg = self.loop.cfg
                    self.loop.cfg = dataclasses.replace(cfg, run=dataclasses.replace(
                        cfg.run, max_restarts=len(self.loop.record.restarts)))
                if fault.kind == "kill-during-restart":  # the first kill; the second armed
                    self.fire(fault, pid, phase="generate (the first kill)")
                    self.armed = fault
                else:
                    self.later(fault, pid, signal.SIGSTOP if fault.kind == "hang"
                               else signal.SIGKILL)

        async def save(self, done: int, save: Any) -> dict[str, Any]:
            self.phase_now = "save"
            saves, trainer = self.loop.saves, self.loop.trainer
            fault = self.due("kill-during-save", "write-failure") if saves.due(done) else None
            if fault is None:
                return await save()
            if fault.kind == "kill-during-save":
                notes = await save()
                written = saves.checkpoints.path(done) / "trainer"
                fault.note = (f"the write of {written.parent.name} had "
                              f"{'ended' if written.exists() else 'not ended'} at the kill")
                self.fire(fault, self.pid_of(trainer, fault.pick), phase="save")
                return notes
            # write-failure: one rank's files limited for the write (EFBIG), then freed
            proc = psutil.Process(self.pid_of(trainer, fault.pick))
            limit = proc.rlimit(psutil.RLIMIT_FSIZE)
            proc.rlimit(psutil.RLIMIT_FSIZE, (64 << 10, limit[1]))
            self.fire(fault, proc.pid, sig=0, phase="save")
            try:
                notes = await save()
                deadline = time.monotonic() + 10
                while any(saves.checkpoints.path(done).glob(".tmp-*")) and \
                        time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
            finally:
                proc.rlimit(psutil.RLIMIT_FSIZE, limit)
            return notes

        async def sync(self, sync: Any) -> None:
            self.phase_now = "handoff"
            fault = self.due("kill-during-handoff")
            if fault is None:
                return await sync()
            handoff = asyncio.ensure_future(sync())
            await asyncio.sleep(fault.delay_s / 4)
            self.fire(fault, self.pid_of(self.loop.trainer, fault.pick),
                      phase="handoff" if not handoff.done() else "after the handoff")
            await handoff

        async def in_restart(self, event: Any) -> None:
            self.note_pids()  # the new generation's
            fault = self.armed
            if fault is not None and fault.pick < 0.5:
                self.armed = None
                self.fire(fault, self.pid_of(self.loop.trainer, 0.0), phase="restart hooks")

        async def loading(self, checkpoint: Path | None) -> None:
            fault = self.armed
            if fault is not None and self.loop.recovery.restarts.events:
                self.armed = None
                self.fire(fault, self.pid_of(self.loop.trainer, 0.0), phase="restart reload")

        async def stopping(self) -> None:
            for pid in self.stopped:  # a stopped proc is killed, never left stopped
                kill(pid, signal.SIGCONT)
            self.note_pids()

    chaos = ChaosHooks()
    Loop(cfg, hooks=chaos)  # sets chaos.loop
    return chaos


def overrides(shape: str, out: Path, args: argparse.Namespace, *more: str) -> list[str]:
    return [*SHAPES[shape], f"run.out={out}", f"run.steps={args.steps}",
            f"run.save_every={args.save_every}", f"run.seed={args.seed}",
            f"run.eval_every={max(1, args.steps // 4)}", "run.keep_last=2",
            f"run.slot_memory={args.slot_memory}", *more]


def per_step(out: Path) -> list[tuple]:
    steps = json.loads((out / "metrics.json").read_text())["steps"]
    return [(s["step"], *(s.get(k) for k in COMPARED)) for s in steps]


def shm_files() -> set[str]:
    found = set()
    for entry in SHM.iterdir() if SHM.is_dir() else ():
        found.add(str(entry))
        if entry.is_dir():
            try:
                found.update(str(p) for p in entry.iterdir())
            except OSError:
                pass
    return found


def child_procs() -> list[psutil.Process]:
    """This process's child procs now, but its fork server, which serves every run here."""
    server = zygote.server_pid()
    return [p for p in psutil.Process().children(recursive=True) if p.pid != server]


def children() -> set[int]:
    """The pids of this process's child procs now (those before a run are not its)."""
    return {p.pid for p in child_procs()}


def leftovers(before: set[str], pids: set[int], older: set[int]) -> dict[str, list]:
    """The child procs the run started still alive (after a grace; `older`: the children
    there before it, such as a test runner's workers, are left alone), and the new
    /dev/shm files a proc of the run made: named with its pid, or in its shared-memory
    record."""
    from colocate.shm_files import recorded

    def started() -> list[psutil.Process]:
        return [p for p in child_procs() if p.pid not in older]

    deadline = time.monotonic() + 5
    while (procs := started()) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [f"{p.pid} {p.name()} ({p.status()})" for p in procs if p.is_running()]
    for proc in procs:  # counted, then ended: the next run starts clean
        kill(proc.pid)
    theirs = {str(path) for pid in pids for path in recorded(pid)}
    pid_names = re.compile(r"(?<!\d)(" + "|".join(str(p) for p in sorted(pids)) + r")(?!\d)")
    files = sorted(f for f in shm_files() - before
                   if f in theirs or (pids and pid_names.search(Path(f).name)))
    return {"procs": alive, "shm": files}


async def run_once(cfg: Any, faults: list[Fault]) -> tuple[Any, BaseException | None]:
    """One run (a loop with `faults`); never waits past the bench's bound without progress."""
    chaos = make_chaos(cfg, faults)
    task = asyncio.ensure_future(chaos.loop.run())
    seen, last = -1, time.monotonic()
    while not task.done():
        await asyncio.wait([task], timeout=1.0)
        chaos.pids.update(p.pid for p in psutil.Process().children(recursive=True))
        if len(chaos.ended) != seen:
            seen, last = len(chaos.ended), time.monotonic()
        elif time.monotonic() - last > HANG_S and chaos.stopped:
            for pid in chaos.stopped:  # the hang was not detected: end it ourselves
                kill(pid)
            for fault in chaos.fired:
                fault.note = f"not detected within {HANG_S:.0f} s: the bench killed it"
            last = time.monotonic()
        elif time.monotonic() - last > 4 * HANG_S:
            task.cancel()
    try:
        await task
        return chaos, None
    except (Exception, asyncio.CancelledError) as err:
        return chaos, err


async def faulted_run(shape: str, faults: list[Fault], args: argparse.Namespace, tmp: Path
                      ) -> dict[str, Any]:
    """The shape's faulted run; a run that stops is resumed (run.resume=auto) until it ends."""
    from examples.rl_loop.config import load_config
    from examples.rl_loop.state import Checkpoints

    out = tmp / f"{shape}-faulted"
    pending, stops, pids = list(faults), [], set()
    before, older = shm_files(), children()
    for _ in range(len(faults) + 2):
        bound = [f"run.call_timeout_s={CALL_BOUND_S}"] if any(
            f.kind == "hang" for f in pending) else []
        cfg = load_config(overrides=overrides(shape, out, args,
                                              f"run.max_restarts={MAX_RESTARTS}", *bound))
        chaos, err = await run_once(cfg, pending)
        failed_at = time.time()
        pids |= chaos.pids
        # detection: the first restart the runtime began, or failed write the chaos found,
        # after the fault
        found = sorted([e.detected_at for e in chaos.loop.recovery.restarts.events]
                       + [w["detected_at"] for w in chaos.loop.saves.write_failures])
        for fault in faults:
            if fault.fired_at and fault.detect_s is None:
                seen = [t for t in found if t >= fault.fired_at - 0.01]
                fault.detect_s = seen[0] - fault.fired_at if seen else None
        if chaos.ended and (resumed_from := [f for f in faults if f.outcome == "stopped"]):
            first = min((t for _, t in chaos.ended), default=None)
            for fault in resumed_from:
                fault.outcome = "stopped, resumed"
                fault.back_s = None if first is None else first - fault.fired_at
                fault.steps_redone = fault.steps_redone - chaos.ended[0][0] if chaos.ended \
                    else None
        pending = list(chaos.pending)
        if err is None:
            for fault in chaos.fired:  # in the last step: the run ended whole all the same
                if fault.kind not in STOPS:
                    fault.outcome, fault.back_s = "went on", failed_at - fault.fired_at
                    fault.steps_redone = sum(r["steps_redone"] for r in
                                             chaos.loop.record.restarts[fault.restarts_before:])
            break
        complete = Checkpoints(out / "checkpoints", 2).complete()
        message = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        stopped = chaos.fired or [f for f in faults if f.fired_at and f.outcome == ""]
        for fault in stopped:
            fault.outcome, fault.error = "stopped", message
            if fault.detect_s is None:  # no restart: the run saw it when it stopped
                fault.detect_s = failed_at - fault.fired_at
            fault.steps_redone = chaos.index  # the resumed run's first step subtracts
        stops.append({"error": message, "at_step": chaos.index,
                      "last_complete_checkpoint": complete[-1].name if complete else None,
                      "names_it": bool(complete) and complete[-1].name in str(err)})
        print(f"  {shape}: the run stopped at step {chaos.index}: {message[:200]} "
              f"(last complete checkpoint: {stops[-1]['last_complete_checkpoint']})")
    else:
        stops.append({"error": "still failing after every resume"})
    found = leftovers(before, pids, older)
    return {"out": out, "stops": stops, "leftovers": found,
            "finished": err is None, "unfired": [f.kind for f in pending]}


async def plain_run(shape: str, args: argparse.Namespace, tmp: Path) -> Path:
    from examples.rl_loop.config import load_config

    out = tmp / f"{shape}-plain"
    chaos, err = await run_once(load_config(overrides=overrides(shape, out, args)), [])
    if err is not None:
        raise RuntimeError(f"the unfaulted {shape} run failed: {err}") from err
    return out


async def chaos(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-chaos-"))
    results: dict[str, Any] = {"runs": [], "faults": []}
    try:
        for shape, faults in plan(args).items():
            began = time.monotonic()
            try:
                plain = await plain_run(shape, args, tmp)
            except RuntimeError as err:  # its faults are not injected: said, not hidden
                print(f"{shape}: {err}")
                results["runs"].append({"shape": shape, "error": str(err)[:500],
                                        "equal_to_unfaulted": False, "stops": [],
                                        "leftovers": {"procs": [], "shm": []}})
                results["faults"] += [f.record() for f in faults]
                continue
            print(f"{shape}: unfaulted run {time.monotonic() - began:.1f} s; faults: "
                  + ", ".join(f"{f.kind}@{f.step}" for f in faults))
            began = time.monotonic()
            run = await faulted_run(shape, faults, args, tmp)
            out = run.pop("out")
            run["equal_to_unfaulted"] = run["finished"] and per_step(out) == per_step(plain)
            run.update(shape=shape, seconds=time.monotonic() - began)
            results["runs"].append(run)
            for fault in faults:
                results["faults"].append(fault.record())
                print(f"  {fault.kind} at step {fault.at_step} ({fault.phase}): "
                      f"{fault.outcome or 'NOT ENDED'}; detection {fmt(fault.detect_s)} s, "
                      f"back to training {fmt(fault.back_s)} s, {fault.steps_redone} "
                      f"step(s) redone{'; ' + fault.note if fault.note else ''}")
            print(f"  {shape}: equal to the unfaulted run: {run['equal_to_unfaulted']}; "
                  f"leftovers: {run['leftovers']}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return results


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def summarize(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    faults, runs = results["faults"], results["runs"]
    fired = [f for f in faults if f["at_step"] is not None]
    ended = [f for f in fired if f["outcome"] in ("went on", "stopped, resumed")
             and (f["outcome"] == "went on" or f["kind"] in STOPS)]
    backs = [f["back_s"] for f in ended if f["back_s"] is not None]
    redone = [f["steps_redone"] for f in ended if f["steps_redone"] is not None]
    return {
        "injected": len(fired), "planned": len(faults), "survived": len(ended),
        "went_on": sum(f["outcome"] == "went on" for f in fired),
        "stopped_then_resumed": sum(f["outcome"] == "stopped, resumed" for f in fired),
        "equal_to_unfaulted": all(r["equal_to_unfaulted"] for r in runs),
        "runs_equal": f"{sum(r['equal_to_unfaulted'] for r in runs)}/{len(runs)}",
        "leftovers": sum(len(r["leftovers"]["procs"]) + len(r["leftovers"]["shm"])
                         for r in runs),
        "back_to_training_s": {"median": statistics.median(backs) if backs else None,
                               "worst": max(backs, default=None)},
        "detect_s": {"median": statistics.median(d) if (d := [
            f["detect_s"] for f in ended if f["detect_s"] is not None]) else None,
            "worst": max(d, default=None)},
        "steps_redone": {"max": max(redone, default=None), "save_every": args.save_every},
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    info, command = announce()
    results = await chaos(args)
    summary = summarize(results, args)
    results = {"machine": info, "command": command, **summary, **results}
    print(f"faults survived / injected: {summary['survived']}/{summary['injected']} "
          f"(went on {summary['went_on']}, stopped then resumed "
          f"{summary['stopped_then_resumed']}); runs equal to the unfaulted run: "
          f"{summary['runs_equal']}; back to training median "
          f"{fmt(summary['back_to_training_s']['median'])} s, worst "
          f"{fmt(summary['back_to_training_s']['worst'])} s; steps redone max "
          f"{summary['steps_redone']['max']} (save_every {args.save_every}); leftovers "
          f"{summary['leftovers']}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return results


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", nargs="+", default=list(MENU),
                        choices=MENU)
    parser.add_argument("--slot-memory", default="64MiB",
                        help="run.slot_memory of every run (auto: see bench/RESULTS.md: a "
                        "run resumed from a checkpoint on one slot cannot wake its trainer)")
    parser.add_argument("--out", help="write the figures and every fault's record (JSON)")
    args = parser.parse_args(argv)
    if args.steps < 4 or args.faults < 1:
        parser.error("--steps >= 4 and --faults >= 1")
    return args


if __name__ == "__main__":
    asyncio.run(main(parse()))
