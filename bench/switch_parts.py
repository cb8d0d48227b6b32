"""Where a switch's time goes, step by step, over a long run of the RL loop on CPU.

Runs `examples.rl_loop`'s `Loop` for `--steps` steps (as `bench.soak` does, without its
checks) and, in every process of the run, wraps the functions a switch passes through,
recording each call's wall start, wall seconds and CPU seconds of its thread
(`time.thread_time`: what other jobs' load moves much less than wall time):

- client: `Switchboard.wake` (the loop's `switch_s`), `Handoffs.handoffs` (its
  `sync_s`), the drain of the services' calls in flight;
- arbiter proc: `SlotArbiter.wake`/`handoff` (the request), `Courier._send` (the plan's
  round trip to the tenant proc);
- tenant proc: `run_here` (the plan carried out), and in it the arena's pause and resume,
  `release_cached` (glibc's `malloc_trim(0)` on CPU, after every pause), the memory
  readings, the leak tracker, the timeline, the progress file;
- gc pauses in each process (`gc.callbacks`); and every 100 steps glibc's `malloc_info` of
  the tenant and arbiter procs: per malloc arena, the free chunks, and those of a page or
  more (`malloc_trim` madvises each of those at every call).

Then prints, per part, the sum per step of its calls (the tenant's and arbiter's calls
attributed to the wake or the handoff whose request they fall in): the median and 10th
percentile of the first `--window` steps and of the last, and their ratios; with
`train_s`, the same computation each step, as the control for other jobs' load. Writes
`parts.json` to `--out`; `--report FILE` prints the tables of a `parts.json` again.

    python -m bench.switch_parts [--steps 2000] [--window 100] [--out runs/switch_parts]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import ctypes
import functools
import gc
import importlib
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

from monarch.actor import Actor, endpoint

# (module, qualified name) of the functions timed in each kind of process
TENANT = [
    ("colocate.arbiter.actor", "run_here"),
    ("colocate.memory.registry", "release_cached"),
    ("colocate.memory.registry", "_reading"),
    ("colocate.memory.arena", "TagArena.pause"),
    ("colocate.memory.arena", "TagArena.resume"),
    ("colocate.telemetry.leaks", "LeakTracker.observe"),
    ("colocate.telemetry.timeline", "Timeline.record"),
    ("colocate.arbiter.plan", "used_here"),
    ("colocate.arbiter.plan", "_Board.mark"),
    ("colocate.engines.generator", "TorchGenerator.receive"),
]
ARBITER = [
    ("colocate.arbiter.core", "SlotArbiter.wake"),
    ("colocate.arbiter.core", "SlotArbiter.handoff"),
    ("colocate.arbiter.delivery", "Courier._send"),
]
CLIENT = [
    ("colocate.resources.switching", "Switchboard._drain"),
    ("colocate.resources.switching", "Switchboard.wake"),
    ("colocate.resources.handoff_client", "Handoffs.handoffs"),
]
POLL_STEPS = 100
PAGE = 4096

# this process's calls: part -> [(wall start, wall seconds, thread CPU seconds), ...]
_times: dict[str, list[tuple[float, ...]]] = {}


def _wrap(owner: Any, attr: str, label: str) -> None:
    original = inspect.getattr_static(owner, attr)
    if getattr(original, "_timed", False):
        return
    record = _times.setdefault(label, [])
    if inspect.iscoroutinefunction(original):
        @functools.wraps(original)
        async def timed(*args: Any, **kwargs: Any) -> Any:
            start, began, cpu = time.time(), time.perf_counter(), time.thread_time()
            try:
                return await original(*args, **kwargs)
            finally:
                record.append((start, time.perf_counter() - began, time.thread_time() - cpu))
    else:
        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start, began, cpu = time.time(), time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                record.append((start, time.perf_counter() - began, time.thread_time() - cpu))
    timed._timed = True  # type: ignore[attr-defined]
    setattr(owner, attr, timed)


def find(module_name: str, qualname: str) -> tuple[Any, str]:
    """The owner of the function `module_name.qualname` and its name there. One that is not
    there (renamed or moved) fails the bench, naming it: a part left out silently would
    read as a part that costs nothing."""
    owner: Any = importlib.import_module(module_name)
    *path, attr = qualname.split(".")
    try:
        for part in path:
            owner = getattr(owner, part)
        getattr(owner, attr)
    except AttributeError:
        raise AttributeError(f"bench/switch_parts.py times {module_name}.{qualname}, "
                             "which is not there any more: update TENANT, ARBITER or "
                             "CLIENT to where that part is now") from None
    return owner, attr


def install(targets: list[tuple[str, str]]) -> list[str]:
    """Time `targets` in this process (each `find`s), and its gc pauses; returns the labels
    of the parts timed."""
    done = []
    for module_name, qualname in targets:
        label = f"{module_name.rsplit('.', 1)[-1]}.{qualname}"
        _wrap(*find(module_name, qualname), label)
        done.append(label)
    pauses = _times.setdefault("gc", [])
    started: dict[str, float] = {}

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.update(t=time.time(), p=time.perf_counter(), c=time.thread_time())
        elif "p" in started:
            pauses.append((started["t"], time.perf_counter() - started["p"],
                           time.thread_time() - started["c"], info["generation"]))

    gc.callbacks.append(on_gc)
    return done


def malloc_stats() -> dict[str, Any]:
    """glibc's `malloc_info` of this process: per arena, its free chunks ("rest": outside
    the fastbins), those of a page or more ("big": each one a madvise in `malloc_trim`),
    and the memory it has from the system."""
    libc = ctypes.CDLL("libc.so.6")
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    with tempfile.NamedTemporaryFile(suffix=".xml") as file:
        stream = libc.fopen(file.name.encode(), b"w")
        libc.malloc_info(0, stream)
        libc.fclose(stream)
        root = ElementTree.parse(file.name).getroot()
    arenas = []
    for heap in root.findall("heap"):
        sizes = heap.find("sizes")
        big = sum(int(s.get("count", 0)) for s in sizes.findall("size")
                  if int(s.get("from", 0)) >= PAGE) if sizes is not None else 0
        rest = next((int(t.get("count", 0)) for t in heap.findall("total")
                     if t.get("type") == "rest"), 0)
        system = next((int(t.get("size", 0)) for t in heap.findall("system")
                       if t.get("type") == "current"), 0)
        arenas.append({"big": big, "rest": rest, "system": system})
    return {"big": sum(a["big"] for a in arenas), "rest": sum(a["rest"] for a in arenas),
            "system": sum(a["system"] for a in arenas), "arenas": arenas}


class Timer(Actor):
    """On a proc of the run: times its parts (`install`); `take` hands over what was
    recorded since the last call, with the proc's malloc statistics."""

    def __init__(self, kind: str) -> None:
        self.done = install(TENANT if kind == "tenant" else ARBITER)

    @endpoint
    def take(self) -> dict[str, Any]:
        got = {key: list(calls) for key, calls in _times.items()}
        for calls in _times.values():
            calls.clear()
        return {"pid": os.getpid(), "parts": self.done, "times": got,
                "malloc": malloc_stats()}


async def run(steps: int, out: Path) -> dict[str, Any]:
    """The loop for `steps` steps with every part timed; the rows and the calls."""
    from examples.rl_loop.config import load_config
    from examples.rl_loop.loop import Loop

    install(CLIENT)
    cfg = load_config(overrides=[f"run.out={out}", f"run.steps={steps}", "run.save_every=0"])
    loop = Loop(cfg)
    await loop.start()
    rows: list[dict[str, Any]] = []
    starts: list[float] = []
    procs: dict[int, dict[str, Any]] = {}
    try:
        groups = {r.allocation.group for svc in (loop.trainer, loop.generator)
                  for r in svc.replicas}
        timers = [loop.runtime.rm.group(g).procs.spawn("parts_timer", Timer, "tenant")
                  for g in sorted(groups)]
        timers.append(loop.runtime.rm.arbiter_procs.spawn("parts_timer", Timer, "arbiter"))

        async def collect(done: int) -> None:
            for timer in timers:
                for _, got in (await timer.take.call()).items():
                    mine = procs.setdefault(got["pid"], {"times": {}, "malloc": []})
                    for key, calls in got["times"].items():
                        mine["times"].setdefault(key, []).extend(calls)
                    mine["malloc"].append((done, got["malloc"]))

        await collect(0)
        for index in range(steps):
            starts.append(time.time())
            rows.append(await loop.step(index))
            if (index + 1) % POLL_STEPS == 0 or index + 1 == steps:
                await collect(index + 1)
                print(f"step {index + 1}: switch {1e3 * rows[-1]['switch_s']:.1f} ms, sync "
                      f"{1e3 * rows[-1]['sync_s']:.1f} ms; load {os.getloadavg()[0]:.2f}",
                      flush=True)
    finally:
        await loop.stop()
    return {"rows": rows, "starts": starts, "client": {k: list(v) for k, v in _times.items()},
            "procs": {str(pid): value for pid, value in procs.items()},
            "load_average_end": os.getloadavg()}


def _p10(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[0] if len(values) > 1 else float("nan")


def report(data: dict[str, Any], window: int) -> None:
    """Print the per-part table of a run (see the module)."""
    rows, starts = data["rows"], data["starts"]
    steps = len(rows)
    first, last = range(window), range(steps - window, steps)

    def per_step(calls: list, within: list[tuple[float, float]] | None = None,
                 cpu: bool = False) -> dict[int, float]:
        out: dict[int, float] = {}
        for call in calls:
            if within is not None:
                i = bisect.bisect_right(within, (call[0], float("inf"))) - 1
                if i < 0 or call[0] > within[i][0] + within[i][1]:
                    continue
            step = bisect.bisect_right(starts, call[0]) - 1
            if step >= 0:
                out[step] = out.get(step, 0.0) + (call[2] if cpu else call[1])
        return out

    def line(name: str, by_step: dict[int, float]) -> None:
        a, b = ([by_step.get(s, 0.0) for s in part] for part in (first, last))
        ma, mb, pa, pb = statistics.median(a), statistics.median(b), _p10(a), _p10(b)
        print(f"| {name} | {1e3 * ma:.3f} | {1e3 * mb:.3f} | {mb / ma if ma else 0:.2f} | "
              f"{1e3 * pa:.3f} | {1e3 * pb:.3f} | {pb / pa if pa else 0:.2f} |")

    print(f"\n{steps} steps; first {window} against last {window}; load average at the end "
          f"{', '.join(f'{x:.2f}' for x in data['load_average_end'])}")
    print("\n| part, ms a step (wall; cpu: the thread's CPU time) | median, first | last | "
          "ratio | 10th percentile, first | last | ratio |\n|---|---:|---:|---:|---:|---:|---:|")
    for key in ("switch_ahead_s", "switch_s", "sync_s", "step_s", "train_s"):
        if key in rows[0]:  # switch_ahead_s: since the wake runs while the loop scores
            line(key, {i: r[key] for i, r in enumerate(rows)})
    for key, calls in sorted(data["client"].items()):
        if calls and key != "gc":
            line(f"client {key}", per_step(calls))
            line(f"client {key}, cpu", per_step(calls, cpu=True))
    arbiter = next(p for p, v in data["procs"].items() if "core.SlotArbiter.wake" in v["times"])
    requests = {name: sorted((c[0], c[1]) for c in data["procs"][arbiter]["times"][
        f"core.SlotArbiter.{name}"]) for name in ("wake", "handoff")}
    for pid, value in data["procs"].items():
        kind = "arbiter" if pid == arbiter else "tenant"
        for key, calls in sorted(value["times"].items()):
            if not calls or key == "gc":
                continue
            for name, within in requests.items():
                if per_step(calls, within):
                    line(f"{kind} {key}, in {name}", per_step(calls, within))
                    line(f"{kind} {key}, in {name}, cpu", per_step(calls, within, cpu=True))
        line(f"{kind} gc", per_step(value["times"].get("gc", [])))
    print("\n| proc | steps | malloc free chunks of a page or more | all free chunks | "
          "arenas' memory MiB |\n|---|---:|---:|---:|---:|")
    for pid, value in data["procs"].items():
        kind = "arbiter" if pid == arbiter else "tenant"
        for done, stats in value["malloc"][::5]:
            print(f"| {kind} {pid} | {done} | {stats['big']} | {stats['rest']} | "
                  f"{stats['system'] / (1 << 20):.0f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--window", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path("runs/switch_parts"))
    parser.add_argument("--report", type=Path, help="print the tables of this parts.json")
    args = parser.parse_args(argv)
    if args.report:
        report(json.loads(args.report.read_text()), args.window)
        return 0
    if args.steps < 2 * args.window:
        parser.error("need --steps >= 2 * --window")
    data = asyncio.run(run(args.steps, args.out))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "parts.json").write_text(json.dumps(data))
    report(data, args.window)
    return 0


if __name__ == "__main__":
    # Run as the module `bench.switch_parts`, so the procs can import `Timer` by name.
    from bench.switch_parts import main as module_main

    sys.exit(module_main())
