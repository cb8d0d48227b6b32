"""Cost of `svc.<endpoint>.route(x)` against a direct Monarch call to the same actor.

A `MemoryTenant` service (`--mib` MiB) is spawned with 1 replica and with 2 replicas (one
proc each, `when_asleep="wait"`, round robin) in one resource group of 2 slots: replica 0
of both services shares slot 0. Each service is made awake with `phase(svc)`, then its
`work(x) -> x` endpoint is called two ways:

- route:  `await svc.work.route(x)` (pick an awake, healthy replica, then `call_one`);
- direct: `await svc.replicas[0].actors.work.call_one(x)` (the same actor, no service).

With 2 replicas, route spreads calls over both replicas, so a third, informative way is
also timed: direct round robin, `call_one` on replica `x % 2`'s actors, as a client
without the service would do it.

1. Sequential latency: `--calls` calls one after another per way (after `--warmup`
   calls), each timed with `time.perf_counter`; p50 ratio route/direct (target <= 1.3).
2. Throughput: `--clients` concurrent tasks issue `--tp-calls` calls in all per way;
   calls/s ratio route/direct (target >= 0.7).

The ways take turns in `--blocks` blocks (the order flips every block), so machine noise
spreads over all of them. Every answer is checked (`work(x)` returns `x`), and afterwards
no call may have reached a replica asleep (the tenant counts those).

    python -m bench.routing [--calls 2000] [--tp-calls 4000] [--clients 16] [--blocks 10]
                            [--warmup 200] [--mib 1] [--out runs/bench_routing/results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.common import announce
from colocate import phase
from colocate.testing import MemoryTenant, start_runtime
from services import Service, ServiceConfig, spawn_service

MAX_P50_RATIO = 1.3
MIN_TP_RATIO = 0.7

Call = Callable[[int], Awaitable[Any]]


async def checked(call: Call, x: int) -> None:
    if (answer := await call(x)) != x:
        raise RuntimeError(f"work({x}) answered {answer!r}")


async def sequential(call: Call, start: int, n: int) -> list[float]:
    """Seconds per call for `n` calls one after another."""
    took = []
    for x in range(start, start + n):
        begin = time.perf_counter()
        await checked(call, x)
        took.append(time.perf_counter() - begin)
    return took


async def concurrent(call: Call, start: int, n: int, clients: int) -> float:
    """Seconds for `clients` tasks to make `n` calls in all."""

    async def client(first: int, count: int) -> None:
        for x in range(first, first + count):
            await checked(call, x)

    shares = [n // clients + (c < n % clients) for c in range(clients)]
    firsts = [start + sum(shares[:c]) for c in range(clients)]
    begin = time.perf_counter()
    await asyncio.gather(*(client(f, s) for f, s in zip(firsts, shares, strict=True)))
    return time.perf_counter() - begin


def ways_of(svc: Service) -> dict[str, Call]:
    actors = [r.actors for r in svc.replicas]
    ways: dict[str, Call] = {"route": svc.work.route, "direct": actors[0].work.call_one}
    if len(actors) > 1:
        ways["direct_rr"] = lambda x: actors[x % len(actors)].work.call_one(x)
    return ways


async def measure(svc: Service, args: argparse.Namespace, bar: tqdm) -> dict[str, Any]:
    """Latency samples and throughput of every way of calling `svc`, in alternating blocks."""
    ways = ways_of(svc)
    names = list(ways)
    latency: dict[str, list[float]] = {n: [] for n in names}
    tp_s = dict.fromkeys(names, 0.0)
    per_block, tp_per_block = args.calls // args.blocks, args.tp_calls // args.blocks
    async with phase(svc):
        for name in names:
            await sequential(ways[name], 0, args.warmup)
            await concurrent(ways[name], 0, args.warmup, args.clients)
        x = 0
        for block in range(args.blocks):
            order = names if block % 2 == 0 else names[::-1]
            for name in order:
                latency[name] += await sequential(ways[name], x, per_block)
                tp_s[name] += await concurrent(ways[name], x, tp_per_block, args.clients)
                x += per_block + tp_per_block
                bar.update(1)
        counts = [await r.actors.counts.call_one() for r in svc.replicas]
    if any(c["asleep"] for c in counts):
        raise RuntimeError(f"calls reached a replica asleep: {counts}")
    result: dict[str, Any] = {"replicas": len(svc.replicas), "counts": counts}
    for name in names:
        samples = sorted(latency[name])
        result[name] = {
            "calls": len(samples), "p50_ms": statistics.median(samples) * 1e3,
            "p99_ms": samples[min(len(samples) - 1, int(0.99 * len(samples)))] * 1e3,
            "mean_ms": statistics.fmean(samples) * 1e3,
            "tp_calls": tp_per_block * args.blocks, "tp_s": tp_s[name],
            "calls_per_s": tp_per_block * args.blocks / tp_s[name]}
    return result


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    async with start_runtime(gpus_per_host=2) as rm:
        # The 2-replica service first: it sizes the group (2 procs); the 1-replica service
        # then takes slot 0 as a second tenant there, and each runs in its own phase.
        config = ServiceConfig(resource_group="bench", when_asleep="wait")
        two = await spawn_service(ServiceConfig(**{**config.__dict__, "num_replicas": 2}),
                                  MemoryTenant, args.mib, name="two", rm=rm)
        one = await spawn_service(config, MemoryTenant, args.mib, name="one", rm=rm)
        services = [one, two]
        total = args.blocks * sum(len(ways_of(s)) for s in services)
        with tqdm(total=total, desc="route vs direct", unit="block") as bar:
            return [await measure(svc, args, bar) for svc in services]


def rows_for(run: dict[str, Any], clients: int) -> list[list[str]]:
    where = f"{run['replicas']} replica{'s' if run['replicas'] > 1 else ''}"
    rows = []
    for other, informative in (("direct", False), ("direct_rr", True)):
        if other not in run:
            continue
        route, base = run["route"], run[other]
        label = f"{where}, vs {other}" if informative else where
        p50 = route["p50_ms"] / base["p50_ms"]
        tp = route["calls_per_s"] / base["calls_per_s"]
        p50_target = "" if informative else f"<= {MAX_P50_RATIO}"
        tp_target = "" if informative else f">= {MIN_TP_RATIO}"
        p50_verdict = "" if informative else ("PASS" if p50 <= MAX_P50_RATIO else "FAIL")
        tp_verdict = "" if informative else ("PASS" if tp >= MIN_TP_RATIO else "FAIL")
        rows += [
            [f"p50 latency ms ({label})", f"{route['p50_ms']:.3f}", f"{base['p50_ms']:.3f}",
             f"{p50:.3f}", p50_target, p50_verdict],
            [f"p99 latency ms ({label})", f"{route['p99_ms']:.3f}", f"{base['p99_ms']:.3f}",
             f"{route['p99_ms'] / base['p99_ms']:.3f}", "", ""],
            [f"throughput calls/s ({label}, {clients} clients)", f"{route['calls_per_s']:.0f}",
             f"{base['calls_per_s']:.0f}", f"{tp:.3f}", tp_target, tp_verdict],
        ]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="sequential calls per way")
    parser.add_argument("--tp-calls", type=int, default=4000, help="concurrent calls per way")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--mib", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_routing/results.json"))
    args = parser.parse_args(argv)
    info, command = announce()
    begin = time.perf_counter()
    runs = asyncio.run(run(args))
    rows = [row for r in runs for row in rows_for(r, args.clients)]
    print("| metric | route | direct | ratio | target | verdict |\n|---|---:|---:|---:|---:|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    verdicts = [row[5] for row in rows if row[5]]
    print(f"{verdicts.count('PASS')}/{len(verdicts)} targets pass; "
          f"{time.perf_counter() - begin:.0f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": info, "command": command, "args": {
        k: str(v) for k, v in vars(args).items()}, "runs": runs, "table": rows}, indent=2))
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    # Run as the module `bench.routing`, as bench/switch.py does, so that anything the procs
    # unpickle from this file has an importable name.
    from bench.routing import main as module_main

    sys.exit(module_main())
