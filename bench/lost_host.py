"""The RL loop on N Slurm hosts, and a host lost mid-run: how long the run takes to start
on N hosts, to see a lost host, and to train again on new ones.

    .venv/bin/python -m bench.lost_host [--hosts 2] [--fault kill|down] [--repeats 1]

Each repeat is a short run of the default task (tiny model, 5 steps, a checkpoint every 2)
on `--hosts` Slurm hosts; as step 3 generates, host 1 is lost: its Slurm task (the worker
and every proc it started) SIGKILLed (`kill`) or its node set down with scontrol (`down`).
Reported: start_s (the loop's start until its services are up on N hosts: sbatch, the
workers, the procs, the models), seen_s (the fault until the run named the host lost),
back_s (the fault until the first step after it ended: the old job stopped, new hosts, the
services spawned, the checkpoint loaded, the redone step), and where the replacement's time
went (stop_s, hosts_s, spawn_s). With SLURM_CONF unset it starts a local cluster of
hosts + 1 nodes (tests/slurm/local_cluster.sh) and stops it at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

SCRIPT = Path(__file__).parents[1] / "tests" / "slurm" / "local_cluster.sh"
FAULT_AT = 3


def _task_of(job: str, node_id: str) -> list[psutil.Process]:
    """Slurm job `job`'s task on its node `node_id`: the worker and what it started."""
    for p in psutil.process_iter(["cmdline"]):
        try:
            env = p.environ()
            if (env.get("SLURM_JOB_ID") == job and env.get("SLURM_NODEID") == node_id
                    and "colocate.resources.worker" in " ".join(p.info["cmdline"] or [])):
                return [p, *p.children(recursive=True)]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    raise RuntimeError(f"no worker of job {job} on its node {node_id}")


async def once(hosts: int, fault: str, out: str) -> dict[str, Any]:
    from examples.rl_loop.config import load_config
    from examples.rl_loop.hooks import Hooks
    from examples.rl_loop.loop import Loop

    class Fault(Hooks):
        index, up, fault_at, back, node = -1, 0.0, 0.0, 0.0, ""

        async def started(self) -> None:
            self.up = time.monotonic()

        async def step_began(self, index: int) -> None:
            self.index = index

        async def phase(self, label: str) -> None:
            if label == "generate" and self.index == FAULT_AT and not self.fault_at:
                job = self.loop.runtime.rm.job
                self.fault_at, self.node = time.time(), job.nodes[1]
                if fault == "kill":
                    for proc in _task_of(job.handle, "1"):
                        proc.send_signal(signal.SIGKILL)
                else:
                    subprocess.run(["scontrol", "update", f"NodeName={self.node}",
                                    "State=DOWN", "Reason=bench"], check=True)

        async def step_ended(self, index: int, row: dict) -> None:
            if self.fault_at and not self.back:
                self.back = time.time()

    cfg = load_config(overrides=[
        "run.steps=5", "run.eval_every=5", "run.save_every=2", "grpo.prompts_per_step=8",
        "task.eval_size=16", "run.cpu_threads=1", f"run.hosts={hosts}",
        "run.scheduler=slurm", f"run.out={out}", "run.resume=none"])
    hooks = Fault()
    began = time.monotonic()
    try:
        await Loop(cfg, hooks=hooks).run()
    finally:
        if fault == "down" and hooks.node:
            subprocess.run(["scontrol", "update", f"NodeName={hooks.node}", "State=RESUME"],
                           capture_output=True)
    restart = json.loads((Path(out) / "metrics.json").read_text())["restarts"][0]
    return {"start_s": hooks.up - began, "seen_s": restart["lost_at"] - hooks.fault_at,
            "back_s": hooks.back - hooks.fault_at,
            **{k: restart[k] for k in ("stop_s", "hosts_s", "spawn_s", "load_and_sync_s")},
            "cause": restart["cause"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--fault", choices=["kill", "down"], default="kill")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default="runs/bench_lost_host.json")
    args = parser.parse_args()
    own = "SLURM_CONF" not in os.environ
    cluster = tempfile.mkdtemp(prefix="colocate_bench_slurm_") if own else ""
    if own:
        started = subprocess.run(["bash", str(SCRIPT), "start", cluster, str(args.hosts + 1)],
                                 capture_output=True, text=True, check=True)
        os.environ["SLURM_CONF"] = started.stdout.strip().split("SLURM_CONF=")[-1]
    try:
        rows = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as out:
                rows.append(asyncio.run(once(args.hosts, args.fault, out)))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        if own:
            subprocess.run(["bash", str(SCRIPT), "stop", cluster], capture_output=True)
    report = {"machine": platform.platform(), "cpus": os.cpu_count(), "hosts": args.hosts,
              "fault": args.fault, "runs": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
