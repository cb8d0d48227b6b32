"""Monarch's own memory per actor call: a bare echo actor, RSS of its proc and of the client.

A reproduction to report upstream: nothing of this project runs in it (only `monarch` and
`psutil`). One proc (`this_host().spawn_procs`), one actor whose endpoints return their
argument or read the proc's RSS; the client calls it (`call_one(...).get()`, one at a time)
until the proc has handled `--warmup` messages, then `--calls` more, and reads the RSS of
the proc and of itself (after `gc.collect()` in both, and `malloc_trim(0)` with `--trim`,
which tells memory glibc kept after a free from memory still in use) after the warm-up and
after each of `--checkpoints` equal parts. The messages are counted in the proc
(`count_messages`), the RSS reads among them. Prints the growth and the bytes per message
of each part and of the whole run, and writes them as JSON with `--out`.

`bench.soak` calls `echo_readings` for its baseline: the same proc's RSS at the message
counts where it read a tenant proc's.

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
from collections import Counter
from importlib.metadata import version
from pathlib import Path
from typing import Any

import psutil
from monarch.actor import Actor, endpoint, this_host

KIB = 1 << 10
_handled: Counter[str] | None = None  # this process's counts, once count_messages() ran


def count_messages() -> Counter[str]:
    """The messages this process's Python actors have handled since the first call, by
    endpoint name: wraps Monarch's `_Actor.handle` and `_Actor.handle_sync`, which every
    message to a Python actor goes through (Monarch counts the same calls in its
    `py_mesages_handled` metric, which cannot be read back). Later calls return the same
    live counter. Messages handled before the first call, and Monarch's own messages that
    reach no Python actor, are not in it."""
    global _handled
    if _handled is None:
        from monarch._src.actor.actor_mesh import _Actor

        counts = _handled = Counter()
        handle, handle_sync = _Actor.handle, _Actor.handle_sync

        async def counted(self: Any, ctx: Any, method: Any, *args: Any, **kwargs: Any) -> None:
            counts[method.name] += 1
            await handle(self, ctx, method, *args, **kwargs)

        def counted_sync(self: Any, ctx: Any, method: Any, *args: Any, **kwargs: Any) -> None:
            counts[method.name] += 1
            handle_sync(self, ctx, method, *args, **kwargs)

        _Actor.handle, _Actor.handle_sync = counted, counted_sync
    return _handled


def trimmed_rss(trim: bool) -> int:
    """This process's RSS after a garbage collection (and glibc's malloc_trim(0) if asked)."""
    gc.collect()
    if trim:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return psutil.Process().memory_info().rss


class Echo(Actor):
    """Answers its argument; reads its own process's RSS and the messages it handled."""

    def __init__(self) -> None:
        self.handled = count_messages()

    @endpoint
    def echo(self, value: Any) -> Any:
        return value

    @endpoint
    def rss(self, trim: bool) -> dict[str, int]:
        """The proc's pid, RSS, and messages handled, this one included."""
        return {"pid": os.getpid(), "rss": trimmed_rss(trim),
                "messages": sum(self.handled.values())}


def echo_readings(marks: list[int], payload_bytes: int = 64, trim: bool = False
                  ) -> list[dict[str, Any]]:
    """Starts one proc with an `Echo` actor, calls `echo` (a dict with a string of
    `payload_bytes`) one call at a time, and reads the proc's RSS and the client's when the
    proc has handled each number of messages in `marks` (counted in the proc, the reads
    included; a mark it has passed already is read at once). Stops the proc; returns the
    readings in the order of the sorted marks."""
    procs = this_host().spawn_procs(per_host={"procs": 1})
    try:
        echo = procs.spawn("echo", Echo)
        payload = {"step": 0, "data": "x" * payload_bytes}
        readings = []
        handled = echo.rss.call_one(trim).get()["messages"]
        for mark in sorted(marks):
            for _ in range(mark - handled - 1):  # the read is the mark's message
                payload["step"] += 1
                echo.echo.call_one(payload).get()
            proc = echo.rss.call_one(trim).get()
            handled = proc["messages"]
            readings.append({"mark": mark, "messages": handled, "proc_rss": proc["rss"],
                             "proc_pid": proc["pid"], "client_rss": trimmed_rss(trim),
                             "time": time.time()})
        return readings
    finally:
        procs.stop().get()


def report(readings: list[dict[str, Any]]) -> dict[str, Any]:
    """Prints each part's growth per message, and returns the whole run's."""
    print("\n| messages | proc RSS MiB | client RSS MiB | proc B/message, this part | "
          "client B/message, this part | messages/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for before, after in zip([None, *readings], readings, strict=False):
        if before is None:
            print(f"| {after['messages']} | {after['proc_rss'] / KIB / KIB:.1f} | "
                  f"{after['client_rss'] / KIB / KIB:.1f} | | | |")
            continue
        messages = after["messages"] - before["messages"]
        print(f"| {after['messages']} | {after['proc_rss'] / KIB / KIB:.1f} | "
              f"{after['client_rss'] / KIB / KIB:.1f} | "
              f"{(after['proc_rss'] - before['proc_rss']) / messages:.0f} | "
              f"{(after['client_rss'] - before['client_rss']) / messages:.0f} | "
              f"{messages / (after['time'] - before['time']):.0f} |")
    first, last = readings[0], readings[-1]
    messages = last["messages"] - first["messages"]
    whole = {"messages": messages,
             "proc_bytes_per_message": (last["proc_rss"] - first["proc_rss"]) / messages,
             "client_bytes_per_message": (last["client_rss"] - first["client_rss"]) / messages}
    print(f"\nwhole run: {messages} messages; proc {whole['proc_bytes_per_message']:.0f} "
          f"B/message ({(last['proc_rss'] - first['proc_rss']) / KIB / KIB:+.1f} MiB), client "
          f"{whole['client_bytes_per_message']:.0f} B/message "
          f"({(last['client_rss'] - first['client_rss']) / KIB / KIB:+.1f} MiB)")
    return whole


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=40_000,
                        help="messages the proc handles after the warm-up")
    parser.add_argument("--warmup", type=int, default=2_000,
                        help="messages the proc handles before the first reading")
    parser.add_argument("--checkpoints", type=int, default=4)
    parser.add_argument("--payload-bytes", type=int, default=64,
                        help="size of the string in the echoed dict")
    parser.add_argument("--trim", action="store_true",
                        help="malloc_trim(0) before each reading, in the proc and the client")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.calls < args.checkpoints or args.checkpoints < 1 or args.warmup < 2:
        parser.error("need --checkpoints >= 1, --calls >= --checkpoints and --warmup >= 2")
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(),
               "python": platform.python_version(), "torchmonarch": version("torchmonarch"),
               "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX")}
    command = shlex.join(sys.orig_argv)
    print(f"machine: {machine} | command: {command}")
    part = args.calls // args.checkpoints
    readings = echo_readings([args.warmup + k * part for k in range(args.checkpoints + 1)],
                             args.payload_bytes, args.trim)
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
