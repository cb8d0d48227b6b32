"""The RL loop colocated and split in one run: step time, switch share, peak memory.

The same config and seed run twice, one after the other: colocated (`run.colocate=true`:
trainer and generator time-share the procs of one resource group) and split (`false`: each
has procs of its own). Each mode runs `--warmup` steps that are not counted (they create the
optimizer state and gradients), then `--steps` measured steps of `Loop.step`, driven from
here; no evaluation runs in between.

Time: the means of the Loop's own per-step figures. Switch share = sum(switch_s + sync_s) /
sum(step_s), as the Loop's summary computes it (target <= 0.10, colocated); sync also alone.
switch_s is what a step waited for switches: the trainer's wake starts as generation ends
and runs while the completions are scored (switch_ahead_s: that wake's own duration).
The floor beside it: a step's switch requests each make two message round trips (client ->
arbiter -> tenant proc, and back) and run one plan in the proc, so no protocol through a
per-host arbiter switches faster than (plans a step) x 2 x (a round trip) + (the plans' time
in the proc). Both are measured in the colocated run: the plans' count and time by the
proc's own clock (`plan.clock`), the round trip as a message to the tenant proc after
`--idle-gap-ms` of quiet, as a switch's messages come after compute (on this 2-core VM one
after 10 ms or more of quiet takes ~3 ms, back to back ~1 ms). Where the floor's share is
itself above 0.10, the target is judged as the two requests' own time (switch_ahead_s +
sync_s) within 1.5x of the floor.

Memory, per proc (a proc stands for a GPU, so what a mode needs is the sum over its procs of
each proc's peak), over the measured steps; ratio = colocated need / split need (target <=
0.65):

(a) Tagged bytes, primary: the model weights, optimizer state, gradients and KV cache that
    the tenants hold under `colocate.memory` tags, what a GPU would hold (activations and
    other untagged temporaries excluded). Exact, not sampled: a `Probe` actor on each proc
    reads the tags' resident bytes before the measured steps and, after, the proc's switch
    timeline, which records every pause and resume with its start and duration. A resume
    counts from its start and a pause until its end, so the handoff's overlap (two weight
    sets) is never missed.
(b) Anonymous RSS above the proc's baseline, sampled every `--interval-ms` ms from
    /proc/<pid>/status on a thread of this process: tagged memory plus everything untagged
    (activations, and what the heap keeps of them after they are freed), which no pause
    releases. The baseline of each proc is a fresh, empty proc that imports the same modules
    (the list read from the tenant proc after the steps) and runs nothing, so the fixed
    Python/torch overhead of a process is subtracted from both modes. Anonymous RSS counts
    private memory (heap, arenas, stacks) and no library pages; USS also counts the library
    pages that no other process maps at that moment, so it moves with what else runs, and
    takes 4-6 ms a reading, too slow to sample at 5 ms. Both are read once at the end, to
    compare. RSS above the baseline is shown too, for information.

Writes a table, `--out` (JSON) and memory.png beside it (memory over time, both modes).

    python -m bench.rl_step [--steps 20] [--warmup 2] [--interval-ms 5] [--idle-gap-ms 50]
                            [--out runs/bench_rl_step/results.json] [section.field=value ...]

The overrides go to the RL loop's config (`model.hidden_size=256 model.layers=4`); this bench sets
run.colocate, run.out, run.steps and run.eval_every itself.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from monarch.actor import Actor, endpoint
from tqdm import tqdm

from bench.common import announce, median_s
from colocate import memory, telemetry
from colocate.arbiter import plan
from colocate.resources.packing import ResourceRequest
from colocate.resources.procs import select
from colocate.resources.start import init

MAX_RATIO = 0.65
MAX_SWITCH_SHARE = 0.10
MAX_OVER_FLOOR = 1.5  # where the floor itself is above the target (bench/switch.py's rule)
IDLE_GAP_MS = 50.0  # the quiet before each timed round trip: a switch comes after compute
MODES = {"colocated": True, "split": False}
ROLES = ("trainer", "generator")
TIMES = ("step_s", "generate_s", "score_s", "train_s", "switch_s", "switch_ahead_s", "sync_s")
MIB = 1 << 20


def proc_memory(pid: int) -> dict[str, int]:
    """RSS and anonymous RSS of a local process, in bytes (one read of /proc/<pid>/status)."""
    found = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                found[key] = int(value.split()[0]) * 1024
    return {"rss": found["VmRSS"], "anon": found["RssAnon"]}


def uss_check(pid: int) -> dict[str, int]:
    """USS (psutil, slow) and anonymous RSS of one process, read back to back."""
    return {"uss": psutil.Process(pid).memory_full_info().uss, "anon": proc_memory(pid)["anon"]}


class Probe(Actor):
    """On a tenant proc: the tags' resident bytes and the proc's switch timeline. On an
    empty proc: its memory once it has imported what a tenant proc imported."""

    @endpoint
    def snapshot(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "time": time.time(),
                "events": telemetry.timeline().recorded,
                "plans": (plan.clock.plans, plan.clock.seconds),
                "resident": {tag: memory.resident_bytes(tag) for tag in memory.tags()},
                "modules": sorted(sys.modules)}

    @endpoint
    def ping(self) -> None:
        """Nothing: a message's round trip."""

    @endpoint
    def events(self, since: int) -> list[tuple[str, str, int, float, float]]:
        return [(e.op, e.tag, e.nbytes, e.start, e.seconds)
                for e in telemetry.timeline().since(since)]

    @endpoint
    def baseline(self, modules: list[str]) -> dict[str, int]:
        failed = 0
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # __main__ of another program, extension internals...
                failed += 1
        return {**uss_check(os.getpid()), **proc_memory(os.getpid()), "failed_imports": failed}


class Sampler(threading.Thread):
    """Reads the memory of `pids` every `interval` seconds until `stop()`."""

    def __init__(self, pids: list[int], interval: float) -> None:
        super().__init__(daemon=True)
        self.pids, self.interval = pids, interval
        self.samples: list[tuple[float, dict[int, dict[str, int]]]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while True:
            self.samples.append((time.time(), {pid: proc_memory(pid) for pid in self.pids}))
            if self.done.wait(self.interval):
                return

    def stop(self) -> None:
        self.done.set()
        self.join()


def tagged_series(start: dict[str, Any], events: list[tuple[str, str, int, float, float]],
                  role_of: dict[str, str]) -> list[tuple[float, dict[str, int]]]:
    """Tagged bytes resident in one proc over time, per role: from the snapshot `start`,
    then each resume from its start and each pause until its end."""
    resident = dict(start["resident"])
    changes = sorted((begin if op == "resume" else begin + seconds, tag,
                      nbytes if op == "resume" else 0)
                     for op, tag, nbytes, begin, seconds in events)

    def per_role() -> dict[str, int]:
        sums = dict.fromkeys(ROLES, 0)
        for tag, nbytes in resident.items():
            sums[role_of[tag.split("/")[0]]] += nbytes
        return sums

    series = [(start["time"], per_role())]
    for at, tag, nbytes in changes:
        resident[tag] = nbytes
        series.append((at, per_role()))
    return series


async def run_mode(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Warm-up and measured steps of one mode; per proc, its roles, tagged series, memory
    samples, the modules it imported and a USS check."""
    # Imported here, not at the top: the procs import this module to unpickle `Probe`, and
    # the loop's plots (matplotlib) would add about 30 MiB to each of them.
    from examples.rl_loop.config import load_config
    from examples.rl_loop.loop import Loop

    total = args.warmup + args.steps
    cfg = load_config(overrides=[
        *args.overrides, f"run.colocate={MODES[name]}", f"run.out={args.out.parent / name}",
        "run.save_every=0",  # the step alone: no checkpoint (bench/recovery.py times those)
        f"run.steps={total + 1}", f"run.eval_every={total + 1}"])  # no evaluation
    loop = Loop(cfg)
    await loop.start()
    try:
        services = {"trainer": loop.trainer, "generator": loop.generator}
        role_of = {r.tenant: role for role, svc in services.items() for r in svc.replicas}
        groups = {r.allocation.group: set() for svc in services.values() for r in svc.replicas}
        for role, svc in services.items():
            for replica in svc.replicas:
                groups[replica.allocation.group].add(role)
        bar = tqdm(range(total), desc=name, unit="step")
        for index in range(args.warmup):
            await loop.step(index)
            bar.update()
        probes = {group: loop.runtime.rm.group(group).procs.spawn("bench_probe", Probe)
                  for group in groups}
        starts = {group: [v for _, v in (await probe.snapshot.call()).items()]
                  for group, probe in probes.items()}
        pids = [s["pid"] for snaps in starts.values() for s in snaps]
        sampler = Sampler(pids, args.interval_ms / 1e3)
        sampler.start()
        rows = []
        for index in range(args.warmup, total):
            rows.append(await loop.step(index))
            bar.update()
        sampler.stop()
        bar.close()
        # a message to a tenant proc after quiet, as each of a step's switch messages
        # comes after compute (one back to back is faster: the threads are still awake)
        idle_rtt = await median_s(list(probes.values())[0].ping.call, 30,
                                  gap_s=args.idle_gap_ms / 1e3)
        procs = []
        for group, probe in probes.items():
            ends = [v for _, v in (await probe.snapshot.call()).items()]
            events = [v for _, v in (await probe.events.call(starts[group][0]["events"])).items()]
            for start, end, evs in zip(starts[group], ends, events, strict=True):
                procs.append({"pid": start["pid"], "roles": sorted(groups[group]),
                              "plans": end["plans"][0] - start["plans"][0],
                              "plan_s": end["plans"][1] - start["plans"][1],
                              "events": evs, "tagged": tagged_series(start, evs, role_of),
                              "modules": end["modules"], "uss_check": uss_check(start["pid"])})
    finally:
        await loop.stop()
    busiest = max(procs, key=lambda p: p["plan_s"])  # the procs run their plans in parallel
    return {"rows": rows, "procs": procs, "samples": sampler.samples,
            **{f"mean_{key}": statistics.mean(r[key] for r in rows) for key in TIMES},
            "idle_round_trip_s": idle_rtt, "idle_gap_ms": args.idle_gap_ms,
            "plans_per_step": busiest["plans"] / len(rows),
            "mean_plan_s": busiest["plan_s"] / len(rows),
            # the procs switch in parallel: the busiest one bounds a step
            "mean_pause_resume_s": max(sum(e[4] for e in p["events"]) for p in procs) / len(rows),
            "switch_share": sum(r["switch_s"] + r["sync_s"] for r in rows)
            / sum(r["step_s"] for r in rows),
            "sync_share": sum(r["sync_s"] for r in rows) / sum(r["step_s"] for r in rows)}


async def baselines(procs: list[dict[str, Any]]) -> None:
    """Each proc's baseline, from a fresh proc per tenant proc that imports its modules."""
    rm = await init("local", gpus_per_host=len(procs))
    try:
        allocation = await rm.allocate(ResourceRequest("baseline", 1, len(procs)), "bench")
        probes = allocation.procs.spawn("bench_probe", Probe)
        for i, proc in enumerate(tqdm(procs, desc="baselines", unit="proc")):
            one = select(probes, hosts=0, gpus=i)
            proc["baseline"] = await one.baseline.call_one(proc["modules"])
    finally:
        await rm.shutdown()


def peaks(mode: dict[str, Any]) -> None:
    """Per proc: peak tagged bytes, peak anonymous RSS and RSS above its baseline."""
    for proc in mode["procs"]:
        pid, base = proc["pid"], proc["baseline"]
        proc["peak_tagged"] = max(sum(by_role.values()) for _, by_role in proc["tagged"])
        for key in ("anon", "rss"):
            proc[f"peak_{key}"] = max(s[pid][key] for _, s in mode["samples"]) - base[key]


def need(mode: dict[str, Any], key: str, role: str | None = None) -> int:
    """The sum of the procs' peaks (each proc a GPU), of the procs that host `role` only."""
    return sum(p[key] for p in mode["procs"] if role is None or p["roles"] == [role])


def tables(coloc: dict[str, Any], split: dict[str, Any]
           ) -> tuple[list[list[str]], list[list[str]], dict[str, float]]:
    """The memory and the time table, and the figures the targets judge."""
    verdicts: dict[str, float] = {}
    memory_rows = []
    for key, label, target in (("peak_tagged", "tagged bytes (a, primary)", True),
                               ("peak_anon", "anonymous RSS above baseline (b)", True),
                               ("peak_rss", "RSS above baseline (informative)", False)):
        ratio = need(coloc, key) / need(split, key)
        verdicts[f"ratio_{key}"] = ratio
        memory_rows.append([
            label, f"{need(coloc, key) / MIB:.2f}", f"{need(split, key, 'trainer') / MIB:.2f}",
            f"{need(split, key, 'generator') / MIB:.2f}", f"{ratio:.3f}",
            f"<= {MAX_RATIO}" if target else "",
            ("PASS" if ratio <= MAX_RATIO else "FAIL") if target else ""])
    time_rows = [[f"mean {key}", f"{coloc[f'mean_{key}']:.4f}", f"{split[f'mean_{key}']:.4f}",
                  "", ""] for key in TIMES]
    share = coloc["switch_share"]
    floor = floor_figures(coloc)
    verdicts.update(switch_share=share, **floor)
    if share <= MAX_SWITCH_SHARE:
        verdict = "PASS"
    else:  # below the target only if the floor is: then judged against the floor
        verdict = "PASS (floor)" if floor["floor_share"] > MAX_SWITCH_SHARE \
            and floor["over_floor"] <= MAX_OVER_FLOOR else "FAIL"
    time_rows += [
        ["switch share (switch_s + sync_s) / step_s", f"{share:.3f}",
         f"{split['switch_share']:.3f}", f"<= {MAX_SWITCH_SHARE}", verdict],
        ["a message's round trip to a tenant proc after "
         f"{coloc['idle_gap_ms']:.0f} ms quiet", f"{coloc['idle_round_trip_s']:.4f}", "", "", ""],
        ["plans a step (one a switch request), and their mean time in the proc",
         f"{coloc['plans_per_step']:.1f}, {coloc['mean_plan_s']:.4f}", "", "", ""],
        ["floor of the two requests: plans x 2 round trips + the plans' time",
         f"{floor['floor_s']:.4f}", "", "", ""],
        ["floor share, floor / step_s", f"{floor['floor_share']:.3f}", "", "", ""],
        ["(switch_ahead_s + sync_s) / floor", f"{floor['over_floor']:.2f}", "",
         f"<= {MAX_OVER_FLOOR} where floor share > {MAX_SWITCH_SHARE}", ""],
        ["sync share sync_s / step_s", f"{coloc['sync_share']:.3f}",
         f"{split['sync_share']:.3f}", "", ""],
        ["mean pause + resume time in the procs, of switch_s + sync_s",
         f"{coloc['mean_pause_resume_s']:.4f}", f"{split['mean_pause_resume_s']:.4f}", "", ""]]
    return memory_rows, time_rows, verdicts


def floor_figures(mode: dict[str, Any]) -> dict[str, float]:
    """What no switch protocol through a per-host arbiter beats on this machine: each
    switch request is two message round trips (client -> arbiter -> proc and back) plus
    the plan's work in the proc."""
    floor = (mode["plans_per_step"] * 2 * mode["idle_round_trip_s"] + mode["mean_plan_s"])
    switching = mode["mean_switch_ahead_s"] + mode["mean_sync_s"]  # the requests' own time
    return {"floor_s": floor, "floor_share": floor / mode["mean_step_s"],
            "over_floor": switching / floor}


def print_table(header: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|---|" + "---:|" * (len(header) - 2) + "---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def plot(modes: dict[str, dict[str, Any]], path: Path) -> None:
    """Tagged bytes and anonymous RSS above baseline over the measured steps, per proc."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 7))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 1, sharex=True)
    colors = {"colocated": matplotlib.colormaps["tab10"](0),
              "split": matplotlib.colormaps["tab10"](1)}
    styles = {"trainer": "--", "generator": ":"}
    for name, mode in modes.items():
        t0 = mode["samples"][0][0]
        for proc in mode["procs"]:
            label = f"{name}: {'+'.join(proc['roles'])} (pid {proc['pid']})"
            style = styles.get("+".join(proc["roles"]), "-")
            points = [(max(at, t0) - t0, sum(r.values()) / MIB) for at, r in proc["tagged"]]
            points.append((mode["samples"][-1][0] - t0, points[-1][1]))
            axes[0].step(*zip(*points, strict=True), where="post", color=colors[name],
                         linestyle=style, label=label)
            base = proc["baseline"]["anon"]
            axes[1].plot([at - t0 for at, _ in mode["samples"]],
                         [(s[proc["pid"]]["anon"] - base) / MIB for _, s in mode["samples"]],
                         color=colors[name], linestyle=style, lw=0.8, label=label)
        for ax, key in zip(axes, ("peak_tagged", "peak_anon"), strict=True):
            ax.axhline(need(mode, key) / MIB, color=colors[name], lw=0.6, alpha=0.6)
    axes[0].set(ylabel="MiB tagged, resident",
                title="memory per proc over the measured steps; thin lines: sum of the "
                      "procs' peaks")
    axes[1].set(xlabel="seconds since the measured steps began",
                ylabel="MiB anonymous RSS above baseline")
    for ax in axes:
        ax.legend(fontsize="small", loc="upper right")
    fig.tight_layout()
    fig.savefig(path, format="png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--interval-ms", type=float, default=5.0)
    parser.add_argument("--idle-gap-ms", type=float, default=IDLE_GAP_MS)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_rl_step/results.json"))
    parser.add_argument("overrides", nargs="*", help="section.field=value for the loop's config")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be >= 1 (warm-up creates the optimizer state)")
    info, command = announce()
    started = time.monotonic()
    modes = {name: asyncio.run(run_mode(name, args)) for name in MODES}
    asyncio.run(baselines([proc for mode in modes.values() for proc in mode["procs"]]))
    for mode in modes.values():
        peaks(mode)
    memory_rows, time_rows, verdicts = tables(modes["colocated"], modes["split"])
    print(f"\n{args.steps} measured steps after {args.warmup} warm-up, each mode; memory "
          f"sampled every {args.interval_ms:g} ms; overrides: {args.overrides or 'none'}")
    print_table(["memory, MiB (sum of per-proc peaks)", "colocated", "split trainer",
                 "split generator", "colocated / split", "target", "verdict"], memory_rows)
    print()
    print_table(["time, s", "colocated", "split", "target", "verdict"], time_rows)
    for name, mode in modes.items():
        for proc in mode["procs"]:
            base, check = proc["baseline"], proc["uss_check"]
            print(f"{name} pid {proc['pid']} ({'+'.join(proc['roles'])}): baseline anon "
                  f"{base['anon'] / MIB:.0f} MiB, RSS {base['rss'] / MIB:.0f} MiB "
                  f"({base['failed_imports']} of {len(proc['modules'])} modules not "
                  f"importable); USS / anon at the end {check['uss'] / check['anon']:.3f}, "
                  f"baseline's {base['uss'] / base['anon']:.3f}")
    elapsed = time.monotonic() - started
    print(f"took {elapsed:.0f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for mode in modes.values():
        for proc in mode["procs"]:
            del proc["modules"]  # thousands of names each; the baselines have used them
    args.out.write_text(json.dumps({
        "machine": info, "command": command, "overrides": args.overrides,
        "steps": args.steps, "warmup": args.warmup, "interval_ms": args.interval_ms,
        "seconds": elapsed, **verdicts, "memory_table": memory_rows, "time_table": time_rows,
        "modes": modes}, indent=1))
    plot(modes, args.out.with_name("memory.png"))
    print(f"results: {args.out}, {args.out.with_name('memory.png')}")
    return 0


if __name__ == "__main__":
    # Run as the module `bench.rl_step`, so the actor class has a name the procs can import.
    from bench.rl_step import main as module_main

    sys.exit(module_main())
