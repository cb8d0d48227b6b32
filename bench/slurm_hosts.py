"""Start-up time of N Monarch hosts from Slurm: `start_hosts("slurm", n)` (sbatch, the job
running, every worker answering), then one proc per host with a first call, then `stop()`
(mesh shut down, job cancelled and gone from squeue).

    .venv/bin/python -m bench.slurm_hosts [--hosts 1,2,3] [--repeats 3] [--out FILE]

With SLURM_CONF unset it starts a local cluster of max(--hosts) nodes for the run
(tests/slurm/local_cluster.sh: root and the slurm packages) and stops it at the end; with
SLURM_CONF set it uses that cluster (extra sbatch options: --partition, --time).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from monarch.actor import Actor, endpoint

from colocate.resources.hosts import start_hosts

SCRIPT = Path(__file__).parents[1] / "tests" / "slurm" / "local_cluster.sh"


class Ping(Actor):
    @endpoint
    def ping(self) -> int:
        return os.getpid()


def once(n: int, options: dict[str, str]) -> dict[str, float]:
    t0 = time.monotonic()
    job = start_hosts("slurm", n, timeout_s=120, **options)
    t1 = time.monotonic()
    procs = job.mesh.spawn_procs(per_host={"gpus": 1})
    pids = procs.spawn("ping", Ping).ping.call().get(timeout=60)
    assert len(list(pids.items())) == n
    t2 = time.monotonic()
    job.stop()
    t3 = time.monotonic()
    left = subprocess.run(["squeue", "-h", "-j", str(job.handle)], capture_output=True,
                          text=True).stdout.strip()
    return {"start_s": t1 - t0, "first_call_s": t2 - t1, "stop_s": t3 - t2,
            "left_in_queue": float(bool(left))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="1,2,3")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--partition", default=None)
    parser.add_argument("--time", default=None)
    parser.add_argument("--out", default="runs/bench_slurm_hosts.json")
    args = parser.parse_args()
    sizes = [int(x) for x in args.hosts.split(",")]
    options = {k: v for k, v in (("partition", args.partition), ("time_limit", args.time)) if v}
    cluster = None
    if "SLURM_CONF" not in os.environ:
        cluster = tempfile.mkdtemp(prefix="bench_slurm_")
        t = time.monotonic()
        out = subprocess.run(["bash", str(SCRIPT), "start", cluster, str(max(sizes))],
                             capture_output=True, text=True, check=True).stdout
        os.environ["SLURM_CONF"] = out.strip().split("SLURM_CONF=")[-1]
        print(f"local cluster of {max(sizes)} nodes up in {time.monotonic() - t:.1f} s")
    rows = []
    try:
        version = subprocess.run(["sinfo", "--version"], capture_output=True,
                                 text=True).stdout.strip()
        print(f"{version}; {platform.platform()}, {os.cpu_count()} CPUs\n")
        print("| hosts | start_hosts s (median, min-max) | first proc call s | stop s | "
              "jobs left |")
        print("|---:|---:|---:|---:|---:|")
        for n in sizes:
            runs = [once(n, options) for _ in range(args.repeats)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            lo, hi = min(r["start_s"] for r in runs), max(r["start_s"] for r in runs)
            rows.append({"hosts": n, "runs": runs, "median": med})
            print(f"| {n} | {med['start_s']:.2f} ({lo:.2f}-{hi:.2f}) | "
                  f"{med['first_call_s']:.2f} | {med['stop_s']:.2f} | "
                  f"{int(sum(r['left_in_queue'] for r in runs))} |", flush=True)
    finally:
        if cluster is not None:
            subprocess.run(["bash", str(SCRIPT), "stop", cluster], check=False)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"version": version, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
