"""Soak: the RL loop for many steps on CPU; does anything grow?

Runs `examples.rl_loop`'s `Loop` (its config, `Loop.start`, `Loop.step`, evaluations as
configured) for `--steps` steps or `--minutes` minutes, whichever comes first, and checks:

- RSS after each sleep, per proc and per tag: every pause a proc makes is in its switch
  timeline (`colocate.telemetry.timeline()`: the proc's RSS right after the pause). A `Probe`
  actor on each proc of the loop's resource groups reads what is new in it every
  `POLL_STEPS` steps (the timeline is a ring of its last events), with the number of
  Monarch messages the proc's actors have handled since the probe started
  (`bench.monarch_growth.count_messages`: every call of `_Actor.handle`/`handle_sync`, the
  probe's own included), also at the first window's two ends. The growth is the median of
  the last `--window` steps less the median of the `--window` steps after the warm-up (raw
  growth). Monarch 0.7.0 itself keeps memory per message a proc handles (bench/RESULTS.md),
  so after the loop the same client runs the bare echo actor of `bench/monarch_growth.py`
  on a fresh proc, reading its RSS at the message counts the tenant proc had at each step
  of the two windows (interpolated between the counter's readings): the echo's growth
  between the same medians is the baseline. Flat means: raw growth less that baseline is at
  most `--rss-slack-mib`. Also whether `ResidualGrowthWarning` fired in a proc (the
  runtime's own leak tracker; the probe records every warning of that class).
- File descriptors, threads (/proc/PID/fd, /proc/PID/task) and the RSS of the client and of
  every process it started (procs, arbiters, host agents), after `--warmup` steps and at the
  end; /dev/shm entries on the machine and those the loop's processes map or hold open.
  Growth is judged on the processes alive at both readings: at most `--fd-slack` fds and
  `--thread-slack` threads per process, no new /dev/shm entry held by them.
- Switch time: the loop's per-step `switch_ahead_s` (the trainer's wake, which the loop
  runs while it scores: its own duration; `switch_s`, what the step waited for it, is shown
  too) and `sync_s`, the last `--window` steps against the first `--window`: medians, and
  the 10th percentiles, which the check judges for the wake (at most
  `--max-switch-ratio`): other jobs' load moves the median, while a switch that costs more
  each step moves every percentile. `train_s` (the same computation each step,
  no switch inside) is shown beside them as the control for a load that changed.

Prints a table, writes `soak.json` (the figures, the RSS after each sleep per proc, tag
and step, the message counts and the echo's readings) and `rss.png` (that RSS over the
steps) to `--out`, and the loop's own
`metrics.json`, reward and memory plots. Exits 1 when a check fails. Not run by pytest:

    python -m bench.soak [--steps 2000] [--minutes 30] [--out runs/soak] [section.field=value ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import psutil
from monarch.actor import Actor, endpoint

from bench.monarch_growth import count_messages, echo_readings
from colocate import telemetry

MIB = 1 << 20
SHM = Path("/dev/shm")
# Steps between two reads of the procs' timelines: 100 steps of the loop record 800 events,
# well inside a timeline's default ring (colocate.telemetry.timeline.DEFAULT_MAX_EVENTS).
POLL_STEPS = 100


class Probe(Actor):
    """On a proc of the loop: records every ResidualGrowthWarning raised in the proc from
    its start on, counts the Monarch messages the proc's actors handle from its start on,
    and gives the proc's pauses (tag, RSS after, when) from its timeline."""

    def __init__(self) -> None:
        self.handled = count_messages()
        self.caught: list[str] = []
        self.seen = telemetry.timeline().recorded  # events before the probe: start-up
        shown = warnings.showwarning

        def show(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
            if issubclass(category, telemetry.ResidualGrowthWarning):
                self.caught.append(str(message))
            shown(message, category, *args, **kwargs)

        warnings.showwarning = show
        warnings.simplefilter("always", telemetry.ResidualGrowthWarning)

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def pauses(self) -> dict[str, Any]:
        """The pauses recorded since the last call (LookupError if the ring dropped some),
        and the messages the proc has handled, this call included: in all and by endpoint."""
        line = telemetry.timeline()
        events = line.since(self.seen)
        self.seen += len(events)
        return {"pid": os.getpid(), "messages": sum(self.handled.values()),
                "by_endpoint": dict(self.handled),
                "pauses": [(e.tag, e.after_bytes, e.start) for e in events if e.op == "pause"]}

    @endpoint
    def summary(self) -> dict[str, Any]:
        """The warnings caught, and what the proc's timeline holds and has dropped."""
        line = telemetry.timeline()
        events = line.events
        held = sum(sys.getsizeof(e) + sys.getsizeof(vars(e))
                   + sum(sys.getsizeof(v) for v in vars(e).values()) for e in events)
        return {"pid": os.getpid(), "warnings": list(self.caught),
                "timeline": {"events": len(events), "bytes": held, "dropped": line.dropped,
                             "max_events": line.max_events}}


def shm_entries() -> set[str]:
    return {entry.name for entry in SHM.iterdir()} if SHM.is_dir() else set()


def process_reading(pid: int) -> dict[str, Any] | None:
    """RSS, fds, threads and the /dev/shm paths a process maps or holds open; None when it
    is gone."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            reading = {"name": " ".join(proc.cmdline()[:3])[:80], "rss": proc.memory_info().rss,
                       "fds": proc.num_fds(), "threads": proc.num_threads()}
        shm = {f.path for f in proc.open_files() if f.path.startswith(str(SHM))}
        shm |= {m.path for m in proc.memory_maps(grouped=True) if m.path.startswith(str(SHM))}
        reading["shm"] = sorted(shm)
        return reading
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def snapshot() -> dict[str, Any]:
    """The client and every process it started, and /dev/shm."""
    me = psutil.Process()
    pids = [me.pid] + [child.pid for child in me.children(recursive=True)]
    found = {pid: process_reading(pid) for pid in pids}
    return {"time": time.time(), "procs": {pid: r for pid, r in found.items() if r},
            "shm": sorted(shm_entries())}


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def p10(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[0] if len(values) > 1 else median(values)


def rss_after_sleeps(probes: list[dict[str, Any]], step_starts: list[float]
                     ) -> dict[str, dict[str, Any]]:
    """Per proc and tag: the RSS after its last pause of each step, by step."""
    import bisect

    series: dict[str, dict[str, Any]] = {}
    for probe in probes:
        for tag, after, at in probe["pauses"]:
            step = bisect.bisect_right(step_starts, at) - 1
            if step < 0:
                continue  # during start-up, before the first step
            key = f"pid {probe['pid']} {tag}"
            entry = series.setdefault(key, {"pid": probe["pid"], "tag": tag, "by_step": {}})
            entry["by_step"][step] = after
    return series


def messages_at(readings: list[tuple[int, int]], step: float) -> float:
    """The messages a proc had handled when `step` steps were done, from its counter's
    readings (steps done, messages handled), sorted by steps: exact at a reading, linear
    between the two around it. ValueError outside the readings."""
    import bisect

    index = bisect.bisect_left(readings, (step,))
    if index < len(readings) and readings[index][0] == step:
        return float(readings[index][1])
    if index == 0 or index == len(readings):
        raise ValueError(f"step {step} is outside the readings, steps {readings[0][0]}-"
                         f"{readings[-1][0]}")
    (before, got_before), (after, got_after) = readings[index - 1], readings[index]
    return got_before + (got_after - got_before) * (step - before) / (after - before)


def windows(warmup: int, window: int, steps: int) -> tuple[range, range]:
    """The steps of the first window (after the warm-up) and of the last."""
    return range(warmup, warmup + window), range(steps - window, steps)


def echo_baseline(readings: list[tuple[int, int]], early: range, late: range
                  ) -> dict[str, Any]:
    """The bare echo actor's RSS growth over the same messages as a tenant proc: its proc
    is read when it has handled as many messages as the tenant proc had at the start of
    each step of the two windows (`readings`: the tenant proc's counter); the growth is the
    median of the late reads less the median of the early ones, as for the tenant."""
    marks = [round(messages_at(readings, step)) for step in (*early, *late)]
    got = echo_readings(marks)
    first, last = got[:len(early)], got[len(early):]
    growth = median([r["proc_rss"] for r in last]) - median([r["proc_rss"] for r in first])
    return {"messages": (marks[0], marks[len(early) - 1], marks[len(early)], marks[-1]),
            "growth": growth, "readings": got}


def judge_rss(series: dict[str, dict[str, Any]], early: range, late: range, slack: int,
              baselines: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per proc and tag: the median RSS after its pauses in the two windows, the growth,
    its proc's echo baseline (`baselines`, by pid), and whether the growth less the
    baseline is at most `slack` bytes."""
    rows = []
    for key, entry in sorted(series.items()):
        by_step = entry["by_step"]
        first = [v for s, v in by_step.items() if s in early]
        last = [v for s, v in by_step.items() if s in late]
        growth = median(last) - median(first)
        baseline = baselines[entry["pid"]]["growth"]
        rows.append({"series": key, "pauses": len(by_step), "early_mib": median(first) / MIB,
                     "late_mib": median(last) / MIB, "growth_mib": growth / MIB,
                     "baseline_mib": baseline / MIB, "net_mib": (growth - baseline) / MIB,
                     "ok": bool(growth - baseline <= slack)})
    return rows


def judge_procs(start: dict[str, Any], end: dict[str, Any], fd_slack: int,
                thread_slack: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows = []
    for pid, before in start["procs"].items():
        after = end["procs"].get(pid)
        if after is None:
            rows.append({"pid": pid, "name": before["name"], "gone": True, "ok": False})
            continue
        new_shm = sorted(set(after["shm"]) - set(before["shm"]))
        rows.append({
            "pid": pid, "name": before["name"], "gone": False,
            "rss_mib": (before["rss"] / MIB, after["rss"] / MIB),
            "fds": (before["fds"], after["fds"]), "threads": (before["threads"], after["threads"]),
            "shm": (len(before["shm"]), len(after["shm"])), "new_shm": new_shm,
            "ok": bool(after["fds"] - before["fds"] <= fd_slack
                       and after["threads"] - before["threads"] <= thread_slack
                       and not new_shm)})
    system = {"shm_entries": (len(start["shm"]), len(end["shm"])),
              "shm_new": sorted(set(end["shm"]) - set(start["shm"])),
              "new_procs": sorted(set(end["procs"]) - set(start["procs"]))}
    return rows, system


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    # Imported here, not at the top: the procs import this module to unpickle `Probe`.
    from tqdm import tqdm

    from examples.rl_loop.config import load_config
    from examples.rl_loop.loop import Loop

    cfg = load_config(overrides=[*args.overrides, f"run.out={args.out}",
                                 f"run.steps={args.steps}", "run.save_every=0"])
    loop = Loop(cfg)
    await loop.start()
    deadline = time.monotonic() + args.minutes * 60
    rows: list[dict[str, Any]] = []
    step_starts: list[float] = []
    try:
        groups = {r.allocation.group for svc in (loop.trainer, loop.generator)
                  for r in svc.replicas}
        probes = [loop.runtime.rm.group(g).procs.spawn("soak_probe", Probe) for g in sorted(groups)]
        proc_pids = [pid for probe in probes for _, pid in (await probe.pid.call()).items()]
        pauses: dict[int, list[tuple[str, int, float]]] = {pid: [] for pid in proc_pids}
        # per proc, at each read: the steps done and the messages handled, in all and by
        # endpoint
        counts: dict[int, list[dict[str, Any]]] = {pid: [] for pid in proc_pids}

        async def collect(done: int) -> None:
            for probe in probes:
                for _, got in (await probe.pauses.call()).items():
                    pauses[got["pid"]].extend(got["pauses"])
                    counts[got["pid"]].append({"steps": done, "messages": got["messages"],
                                               "by_endpoint": got["by_endpoint"]})

        start = None
        bar = tqdm(total=args.steps, desc="soak", unit="step")
        for index in range(args.steps):
            if time.monotonic() > deadline:
                break
            if index == args.warmup:
                start = snapshot()
                await collect(index)
            step_starts.append(time.time())
            row = await loop.step(index)
            loop.record.step(row)
            rows.append(row)
            if (index + 1) % POLL_STEPS == 0 or index + 1 == args.warmup + args.window:
                await collect(index + 1)
            bar.update()
            bar.set_postfix({"switch_ms": f"{1e3 * row['switch_ahead_s']:.1f}",
                             "sync_ms": f"{1e3 * row['sync_s']:.1f}",
                             "reward": f"{row['reward']:.2f}"}, refresh=False)
        bar.close()
        await asyncio.sleep(1.0)  # let the last step's threads and files settle
        end = snapshot()
        if not counts[proc_pids[0]] or counts[proc_pids[0]][-1]["steps"] != len(rows):
            await collect(len(rows))  # unless the last step's poll read it all
        found = [{**value, "pauses": pauses[value["pid"]], "counts": counts[value["pid"]]}
                 for probe in probes for _, value in (await probe.summary.call()).items()]
    finally:
        await loop.stop()
    if start is None:
        raise SystemExit(f"the run ended after {len(rows)} steps, before the warm-up of "
                         f"{args.warmup} steps was over: give more --steps or --minutes")
    loop.record.write(args.out, {"soak_steps": len(rows)})
    return {"rows": rows, "step_starts": step_starts, "start": start, "end": end,
            "probes": found, "proc_pids": proc_pids, "client_pid": os.getpid()}


def plot(series: dict[str, dict[str, Any]], rows: list[dict[str, Any]], path: Path) -> None:
    """RSS after each sleep per proc and tag, and switch + sync time, over the steps."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 8))
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)
    for key, entry in sorted(series.items()):
        steps = sorted(entry["by_step"])
        top.plot(steps, [entry["by_step"][s] / MIB for s in steps], lw=0.8, label=key)
    top.set(ylabel="RSS after the pause, MiB", title="RSS of each proc right after each "
            "sleep (last pause of the tag in each step)")
    top.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    steps = [r["step"] for r in rows]
    bottom.plot(steps, [1e3 * r["switch_ahead_s"] for r in rows], lw=0.5,
                label="switch_ahead_s (the wake)")
    bottom.plot(steps, [1e3 * r["sync_s"] for r in rows], lw=0.5, label="sync_s")
    bottom.set(xlabel="step", ylabel="ms", yscale="log", title="switch and sync time per step")
    bottom.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(path, format="png")


def window_size(steps: int, args: argparse.Namespace) -> int:
    """The steps in each window: `--window`, or fewer when the run was cut short."""
    return min(args.window, max(1, (steps - args.warmup) // 2))


def baselines(result: dict[str, Any], args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    """The echo baseline (`echo_baseline`) of each proc that paused (a tenant proc), by
    pid, run one after another on fresh procs of this host."""
    steps = len(result["rows"])
    early, late = windows(args.warmup, window_size(steps, args), steps)
    found = {}
    for probe in result["probes"]:
        if not probe["pauses"]:
            continue
        print(f"echo baseline for pid {probe['pid']}: a bare Monarch actor, read at the "
              "message counts of the proc's two windows ...", flush=True)
        found[probe["pid"]] = echo_baseline(
            [(c["steps"], c["messages"]) for c in probe["counts"]], early, late)
    return found


def report(result: dict[str, Any], args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    """Prints the figures and the checks; returns them for soak.json, and whether every
    check passed."""
    rows, steps = result["rows"], len(result["rows"])
    window = window_size(steps, args)
    early, late = windows(args.warmup, window, steps)
    series = rss_after_sleeps(result["probes"], result["step_starts"])
    rss_rows = judge_rss(series, early, late, args.rss_slack_mib * MIB, result["baselines"])
    proc_rows, system = judge_procs(result["start"], result["end"], args.fd_slack,
                                     args.thread_slack)
    caught = {p["pid"]: p["warnings"] for p in result["probes"] if p["warnings"]}
    switch = {}
    # train_s is the control: the same computation every step, with no switch or Monarch
    # message inside it, so its ratio is what other jobs' load alone did to the step
    for key in ("switch_ahead_s", "switch_s", "sync_s", "step_s", "train_s"):
        first, last = ([r[key] for r in part] for part in (rows[:window], rows[-window:]))
        switch[key] = {"first_ms": 1e3 * median(first), "last_ms": 1e3 * median(last),
                       "ratio": median(last) / median(first), "first_p10_ms": 1e3 * p10(first),
                       "last_p10_ms": 1e3 * p10(last), "p10_ratio": p10(last) / p10(first)}
    # judged on the 10th percentile: other jobs' load moves the median and the tail, while a
    # switch that costs more each step moves every percentile
    switch_ok = switch["switch_ahead_s"]["p10_ratio"] <= args.max_switch_ratio
    checks = {"rss_flat": all(r["ok"] for r in rss_rows), "no_residual_growth_warning":
              not caught, "fds_threads_shm": all(r["ok"] for r in proc_rows),
              "switch_time": switch_ok}

    elapsed = result["end"]["time"] - result["step_starts"][0]
    print(f"\n{steps} steps in {elapsed:.0f} s; warm-up {args.warmup}, window {window} "
          f"steps; load average at the end "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("\n| proc, tag | pauses | RSS after sleep, MiB: steps "
          f"{args.warmup}-{args.warmup + window - 1} | last {window} | growth | echo baseline "
          f"| growth - baseline | verdict ({args.rss_slack_mib} MiB) |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rss_rows:
        print(f"| {r['series']} | {r['pauses']} | {r['early_mib']:.1f} | {r['late_mib']:.1f} | "
              f"{r['growth_mib']:+.1f} | {r['baseline_mib']:+.1f} | {r['net_mib']:+.1f} | "
              f"{'ok' if r['ok'] else 'GREW'} |")
    for probe in result["probes"]:
        base = result["baselines"].get(probe["pid"])
        if base is None:
            continue
        first, last = probe["counts"][0], probe["counts"][-1]
        rate = {name: (got - first["by_endpoint"].get(name, 0)) / (last["steps"] - first["steps"])
                for name, got in sorted(last["by_endpoint"].items())}
        print(f"pid {probe['pid']}: Monarch messages handled (counted in the proc from the "
              f"probe's start) at the first window's steps {base['messages'][0]}-"
              f"{base['messages'][1]}, at the last's {base['messages'][2]}-"
              f"{base['messages'][3]}; steps {first['steps']}-{last['steps']}: "
              f"{(last['messages'] - first['messages']) / (last['steps'] - first['steps']):.2f} "
              f"a step ({', '.join(f'{k} {v:.2f}' for k, v in rate.items() if v)}); the echo "
              f"proc (pid {base['readings'][0]['proc_pid']}) read at the same counts grew "
              f"{base['growth'] / MIB:+.1f} MiB")
    print("\n| process | RSS MiB start → end | fds | threads | /dev/shm held | verdict |")
    print("|---|---:|---:|---:|---:|---|")
    for r in proc_rows:
        if r["gone"]:
            print(f"| {r['pid']} {r['name']} | gone | | | | GONE |")
            continue
        print(f"| {r['pid']} {r['name']} | {r['rss_mib'][0]:.0f} → {r['rss_mib'][1]:.0f} | "
              f"{r['fds'][0]} → {r['fds'][1]} | {r['threads'][0]} → {r['threads'][1]} | "
              f"{r['shm'][0]} → {r['shm'][1]} | {'ok' if r['ok'] else 'GREW'} |")
    print(f"\n/dev/shm entries on the machine: {system['shm_entries'][0]} → "
          f"{system['shm_entries'][1]} (other jobs too); new: {system['shm_new'] or 'none'}; "
          f"processes started after the warm-up: {system['new_procs'] or 'none'}")
    print(f"ResidualGrowthWarning: {caught or 'none'}")
    for probe in result["probes"]:
        line = probe["timeline"]
        print(f"pid {probe['pid']}: its switch timeline holds {line['events']} events "
              f"(bound {line['max_events']}, {line['dropped']} dropped), about "
              f"{line['bytes'] / MIB:.1f} MiB")
    print(f"\n| per step, ms | median, first {window} | last {window} | last / first | "
          f"10th percentile, first {window} | last {window} | last / first |\n"
          "|---|---:|---:|---:|---:|---:|---:|")
    for key, value in switch.items():
        print(f"| {key} | {value['first_ms']:.1f} | {value['last_ms']:.1f} | "
              f"{value['ratio']:.2f} | {value['first_p10_ms']:.1f} | "
              f"{value['last_p10_ms']:.1f} | {value['p10_ratio']:.2f} |")
    print(f"\nchecks: {json.dumps(checks)}")
    figures = {"steps": steps, "seconds": elapsed, "window": window, "warmup": args.warmup,
               "checks": checks, "rss": rss_rows, "procs": proc_rows, "system": system,
               "messages": {p["pid"]: p["counts"] for p in result["probes"]},
               "echo_baselines": result["baselines"],
               "warnings": caught, "switch": switch,
               "timelines": {p["pid"]: p["timeline"] for p in result["probes"]},
               "rss_after_sleep": {key: entry["by_step"] for key, entry in series.items()},
               "load_average_end": os.getloadavg()}
    plot(series, rows, args.out / "rss.png")
    return figures, all(checks.values())


def main(argv: list[str] | None = None) -> int:
    from bench.common import announce

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--warmup", type=int, default=20,
                        help="steps before the start readings (lazy threads, pools, caches)")
    parser.add_argument("--window", type=int, default=100)
    # 8 MiB: with Monarch's own growth taken out, the default run's tenant proc grew 2.5 and
    # 2.8 MiB in two runs, 1.8 MiB of it its switch timeline filling its ring (bench/RESULTS.md,
    # soak); 8 MiB fails a further growth of about 3 KiB a step between the windows
    parser.add_argument("--rss-slack-mib", type=int, default=8,
                        help="the most a tenant proc's RSS after its sleeps may grow between "
                        "the windows, beyond the echo baseline's growth")
    parser.add_argument("--fd-slack", type=int, default=2)
    parser.add_argument("--thread-slack", type=int, default=2)
    parser.add_argument("--max-switch-ratio", type=float, default=1.5)
    parser.add_argument("--out", type=Path, default=Path("runs/soak"))
    parser.add_argument("overrides", nargs="*", help="section.field=value for the loop's config")
    args = parser.parse_args(argv)
    if args.steps < 2 * args.warmup or args.warmup < 1 or args.window < 1:
        parser.error("need --warmup >= 1, --window >= 1 and --steps >= 2 * --warmup")
    info, command = announce()
    result = asyncio.run(soak(args))
    result["baselines"] = baselines(result, args)
    figures, ok = report(result, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(
        {"machine": info, "command": command, "overrides": args.overrides, **figures,
         "rows": result["rows"]}, indent=1, default=str))
    print(f"results: {args.out / 'soak.json'}, {args.out / 'rss.png'}; "
          f"{'all checks passed' if ok else 'a check FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    # Run as the module `bench.soak`, so the procs can import the probe's class by name.
    from bench.soak import main as module_main

    sys.exit(module_main())
