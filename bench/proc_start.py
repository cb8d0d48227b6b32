"""A proc's start with and without the fork server (`colocate.resources.zygote`), side by
side in one run: a runtime's `init` (its arbiter proc), a group's procs started
(`allocate`), a tenant spawned on them, and the CPU seconds each proc had used by then.

    python -m bench.proc_start [--procs 2] [--rounds 3] [--out FILE]

Rounds alternate the two ways, so a drift of the machine's speed falls on both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Any

from monarch.actor import Actor, endpoint

from bench.common import announce
from colocate.resources.packing import ResourceRequest
from colocate.resources.zygote import FORK_PROCS_ENV
from colocate.testing import start_runtime

WAYS = {"forked": None, "own start": "0"}  # FORK_PROCS_ENV's value for each


class CpuProbe(Actor):
    """Tells the CPU seconds its proc has used."""

    @endpoint
    async def cpu_s(self) -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime


async def one_start(procs: int) -> dict[str, float]:
    """Seconds of init, allocate and spawn, and the procs' mean CPU seconds after them."""
    start = time.perf_counter()
    async with start_runtime(gpus_per_host=procs) as rm:
        init_s = time.perf_counter() - start
        request = ResourceRequest("bench", hosts=1, procs_per_host=procs)
        start = time.perf_counter()
        allocation = await rm.allocate(request, owner="probe")
        allocate_s = time.perf_counter() - start
        start = time.perf_counter()
        probe = await rm.spawn("probe", CpuProbe, allocation)
        cpu = [value for _, value in (await probe.cpu_s.call()).items()]
        spawn_s = time.perf_counter() - start
    return {"init_s": init_s, "allocate_s": allocate_s, "spawn_s": spawn_s,
            "proc_cpu_s": statistics.mean(cpu)}


async def measure(procs: int, rounds: int) -> dict[str, dict[str, float]]:
    runs: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    for index in range(rounds):
        for way, value in WAYS.items():
            if value is None:
                os.environ.pop(FORK_PROCS_ENV, None)
            else:
                os.environ[FORK_PROCS_ENV] = value
            runs[way].append(await one_start(procs))
            print(f"round {index + 1}/{rounds} {way}: " + ", ".join(
                f"{k} {v:.2f}" for k, v in runs[way][-1].items()), flush=True)
    return {way: {key: statistics.median(run[key] for run in done) for key in done[0]}
            for way, done in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    machine, command = announce()
    medians = measure(args.procs, args.rounds)
    result: dict[str, Any] = asyncio.run(medians)
    forked, own = result["forked"], result["own start"]
    print(f"\nmedians of {args.rounds} rounds, {args.procs} procs:")
    print(f"{'':12} {'forked':>8} {'own start':>10} {'ratio':>7}")
    for key in forked:
        print(f"{key:12} {forked[key]:8.2f} {own[key]:10.2f} {own[key] / forked[key]:6.1f}x")
    if args.out:
        args.out.write_text(json.dumps({"machine": machine, "command": command,
                                        "procs": args.procs, "medians": result}, indent=1))


if __name__ == "__main__":
    main()
