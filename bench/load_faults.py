"""Routed load with phase switches and a killed proc, larger than its CI test
(tests/test_load_faults.py): the numbers, with the kill and without.

The scenario is tests/load_scenario.py: a "trainer" service (2 replicas x 2 procs) and a
"generator" service (4 replicas x 1 proc) share 4 slots; phases alternate every 20-100 ms;
`--clients` concurrent clients send `--calls` routed calls, one in 20 an endpoint error; in
the runs with a kill, a random generator replica's proc (which also hosts a trainer rank)
is SIGKILLed at a random moment. Per run: calls/s, latency p50/p99, calls lost, errors that
reached another caller, calls served asleep (callers' and tenants' counts), phases and
failed phases, and for a kill how long each service took to see its replica fail and to
have it back.

    python -m bench.load_faults [--calls 10000] [--clients 200] [--runs 2]
                                [--out runs/bench_load_faults/results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.common import announce
from colocate.testing import start_runtime

# the load scenario is the tests' own (tests/load_scenario.py, shared with
# tests/test_load_faults.py), imported by the name the tests and the procs know it by
TESTS = str(Path(__file__).resolve().parents[1] / "tests")
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)


async def one_run(calls: int, clients: int, kill: bool, seed: int) -> dict[str, Any]:
    from load_scenario import run_load

    async with start_runtime(gpus_per_host=4) as rm:
        report = await run_load(rm, calls=calls, clients=clients, kill=kill, seed=seed)
    print(("kill:    " if kill else "no kill: ") + report.summary())
    lat = sorted(report.latencies_s)
    out = asdict(report)
    out.pop("latencies_s")
    out.update(kill=kill, calls_per_s=calls / report.seconds,
               p50_ms=statistics.median(lat) * 1e3,
               p99_ms=lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3,
               lost=len(report.lost), lost_examples=report.lost[:5],
               errors_to_others=len(report.errors_to_others),
               failed_phases=len(report.phase_errors), phase_errors=report.phase_errors[:20])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=10000)
    parser.add_argument("--clients", type=int, default=200, help="concurrent clients")
    parser.add_argument("--runs", type=int, default=2, help="runs with a kill, and as many without")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_load_faults/results.json"))
    args = parser.parse_args(argv)
    info, command = announce()
    os.environ["PYTHONPATH"] = os.pathsep.join((str(TESTS), os.environ["PYTHONPATH"]))
    begin = time.perf_counter()
    runs = [asyncio.run(one_run(args.calls, args.clients, kill, seed))
            for seed in range(args.runs) for kill in (False, True)]
    print("| run | calls/s | p50 ms | p99 ms | lost | to others | asleep | phases (failed) "
          "| seen failed s | back s |\n|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for r in runs:
        print(f"| {'kill' if r['kill'] else 'no kill'} | {r['calls_per_s']:.0f} | "
              f"{r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['lost']} | {r['errors_to_others']} | "
              f"{r['asleep_seen_by_callers'] + r['asleep_counted_by_tenants']} | "
              f"{r['phases']} ({r['failed_phases']}) | "
              + ", ".join(f"{k} {v:.2f}" for k, v in r["failed_s"].items()) + " | "
              + ", ".join(f"{k} {v:.1f}" for k, v in r["back_s"].items()) + " |")
    print(f"{time.perf_counter() - begin:.0f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": info, "command": command, "args": {
        k: str(v) for k, v in vars(args).items()}, "runs": runs}, indent=2))
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
