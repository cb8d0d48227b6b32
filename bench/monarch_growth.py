"""Monarch's own memory per actor call: a bare echo actor, RSS of its proc and of the client.

A reproduction to report upstream: nothing of this project runs in it (only `monarch` and
`psutil`). One proc (`this_host().spawn_procs`), one actor whose only endpoint returns its
argument; the client calls it `--calls` times (`call_one(...).get()`, one at a time) after
`--warmup` calls, and reads the RSS of the proc and of itself (after `gc.collect()` in both,
and `malloc_trim(0)` with `--trim`, which tells memory glibc kept after a free from memory
still in use) before the calls and after each of `--checkpoints` equal parts. Prints the
growth and the bytes per call of each part and of the whole run, and writes them as JSON
with `--out`.

    python -m bench.monarch_growth [--calls 40000] [--warmup 2000] [--checkpoints 4]
                                   [--payload-bytes 64] [--trim] [--out FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import shlex
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import psutil
from monarch.actor import Actor, endpoint, this_host

KIB = 1 << 10


def trimmed_rss(trim: bool) -> int:
    """This process's RSS after a garbage collection (and glibc's malloc_trim(0) if asked)."""
    gc.collect()
    if trim:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return psutil.Process().memory_info().rss


class Echo(Actor):
    """Answers its argument; reads its own process's RSS."""

    @endpoint
    def echo(self, value: Any) -> Any:
        return value

    @endpoint
    def rss(self, trim: bool) -> dict[str, int]:
        return {"pid": os.getpid(), "rss": trimmed_rss(trim)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    procs = this_host().spawn_procs(per_host={"procs": 1})
    echo = procs.spawn("echo", Echo)
    payload = {"step": 0, "data": "x" * args.payload_bytes}
    for _ in range(args.warmup):
        echo.echo.call_one(payload).get()
    readings = []

    def read(calls: int) -> None:
        proc = echo.rss.call_one(args.trim).get()
        readings.append({"calls": calls, "proc_rss": proc["rss"], "proc_pid": proc["pid"],
                         "client_rss": trimmed_rss(args.trim), "time": time.time()})

    read(0)
    part = args.calls // args.checkpoints
    done = 0
    for _ in range(args.checkpoints):
        for _ in range(part):
            payload["step"] = done
            echo.echo.call_one(payload).get()
            done += 1
        read(done)
    procs.stop().get()
    return {"readings": readings}


def report(readings: list[dict[str, Any]]) -> dict[str, Any]:
    print("\n| calls | proc RSS MiB | client RSS MiB | proc B/call, this part | "
          "client B/call, this part | calls/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for before, after in zip([None, *readings], readings, strict=False):
        if before is None:
            print(f"| {after['calls']} | {after['proc_rss'] / KIB / KIB:.1f} | "
                  f"{after['client_rss'] / KIB / KIB:.1f} | | | |")
            continue
        calls = after["calls"] - before["calls"]
        print(f"| {after['calls']} | {after['proc_rss'] / KIB / KIB:.1f} | "
              f"{after['client_rss'] / KIB / KIB:.1f} | "
              f"{(after['proc_rss'] - before['proc_rss']) / calls:.0f} | "
              f"{(after['client_rss'] - before['client_rss']) / calls:.0f} | "
              f"{calls / (after['time'] - before['time']):.0f} |")
    first, last = readings[0], readings[-1]
    calls = last["calls"] - first["calls"]
    whole = {"calls": calls,
             "proc_bytes_per_call": (last["proc_rss"] - first["proc_rss"]) / calls,
             "client_bytes_per_call": (last["client_rss"] - first["client_rss"]) / calls}
    print(f"\nwhole run: {calls} calls; proc {whole['proc_bytes_per_call']:.0f} B/call "
          f"({(last['proc_rss'] - first['proc_rss']) / KIB / KIB:+.1f} MiB), client "
          f"{whole['client_bytes_per_call']:.0f} B/call "
          f"({(last['client_rss'] - first['client_rss']) / KIB / KIB:+.1f} MiB)")
    return whole


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=40_000)
    parser.add_argument("--warmup", type=int, default=2_000)
    parser.add_argument("--checkpoints", type=int, default=4)
    parser.add_argument("--payload-bytes", type=int, default=64,
                        help="size of the string in the echoed dict")
    parser.add_argument("--trim", action="store_true",
                        help="malloc_trim(0) before each reading, in the proc and the client")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.calls < args.checkpoints or args.checkpoints < 1:
        parser.error("need --checkpoints >= 1 and --calls >= --checkpoints")
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(),
               "python": platform.python_version(), "torchmonarch": version("torchmonarch"),
               "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX")}
    command = shlex.join(sys.orig_argv)
    print(f"machine: {machine} | command: {command}")
    readings = run(args)["readings"]
    whole = report(readings)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": machine, "command": command,
                                        "args": {k: str(v) for k, v in vars(args).items()},
                                        "readings": readings, **whole}, indent=1))
    return 0


if __name__ == "__main__":
    # The procs unpickle `Echo` by its module's name: import this file as the module
    # `monarch_growth` from its own folder, and give the procs that folder too.
    here = str(Path(__file__).resolve().parent)
    sys.path.insert(0, here)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH"))
                                               if p)
    import monarch_growth

    sys.exit(monarch_growth.main())
