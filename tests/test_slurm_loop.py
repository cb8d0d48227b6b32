"""The RL loop on two hosts of a real Slurm cluster (the `slurm_cluster` fixture): a short
run of the default task (a tiny model, a few steps) learns, runs on both nodes with the
generator on the trainer's procs, and equals step by step the same run, same seed, on two
"processes" hosts; nothing is left behind (no Slurm job, no process of the job, no
/dev/shm file of its procs).

Each run is its own fresh process (`isolated`): attaching to Slurm's workers sets Monarch's
transport for the whole process.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import psutil
import pytest
from slurm_cluster import left_of

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(420)]
SHM = Path("/dev/shm")
# a short run: enough steps for the rewards to move, each step a second or two
SHORT = ["run.steps=3", "run.eval_every=3", "run.save_every=2", "grpo.prompts_per_step=8",
         "task.eval_size=16", "run.cpu_threads=1", "run.resume=none"]
TIMINGS = re.compile(r"(_s|_share|per_s)$")  # a step's clock: differs from run to run


def _node(pid: int) -> str:
    """The Slurm node a proc runs on ("" outside Slurm): its SLURMD_NODENAME."""
    try:
        return psutil.Process(pid).environ().get("SLURMD_NODENAME", "")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "?"


def _shm_files() -> set[str]:
    return {str(p) for p in SHM.iterdir()} if SHM.is_dir() else set()


async def _run(out: str, scheduler: str) -> dict[str, Any]:
    from examples.rl_loop.config import load_config
    from examples.rl_loop.hooks import Hooks
    from examples.rl_loop.loop import Loop
    from examples.rl_loop.memory import tenant_infos

    class Where(Hooks):
        """Which procs (pid, node) each service runs on, once they are up."""

        procs: dict[str, list[tuple[int, str]]] = {}

        async def started(self) -> None:
            for name, service in self.loop.runtime.services().items():
                self.procs[name] = sorted((i.pid, _node(i.pid))
                                          for i in await tenant_infos(service))

    cfg = load_config(overrides=[*SHORT, "run.hosts=2", f"run.scheduler={scheduler}",
                                 f"run.out={out}"])
    before = _shm_files()
    hooks = Where()
    loop = Loop(cfg, hooks=hooks)
    summary = await loop.run()
    pids = {pid for procs in hooks.procs.values() for pid, _ in procs}
    named = re.compile(r"(?<!\d)(" + "|".join(map(str, sorted(pids))) + r")(?!\d)")
    job = loop.runtime.rm.job
    return {"summary": summary, "procs": hooks.procs, "job": job.handle,
            "alive": [p for p in pids if psutil.pid_exists(p)
                      and psutil.Process(p).status() != psutil.STATUS_ZOMBIE],
            "shm": sorted(f for f in _shm_files() - before if named.search(Path(f).name)),
            "steps": json.loads((Path(out) / "metrics.json").read_text())["steps"]}


def run_loop(out: str, scheduler: str) -> dict[str, Any]:
    return asyncio.run(_run(out, scheduler))


def test_two_slurm_hosts_run_the_loop_as_two_processes_hosts_do(slurm_cluster, isolated,
                                                                tmp_path):
    slurm = isolated(run_loop, str(tmp_path / "slurm"), "slurm")
    local = isolated(run_loop, str(tmp_path / "processes"), "processes")
    # on both nodes, the generator in the trainer's procs: one replica per slot
    trainer, generator = slurm["procs"]["trainer"], slurm["procs"]["generator"]
    nodes = [node for _, node in trainer]
    assert len(set(nodes)) == 2 and set(nodes) <= set(slurm_cluster.nodes), trainer
    assert generator == trainer
    assert local["procs"]["generator"] == local["procs"]["trainer"]
    assert len(local["procs"]["trainer"]) == 2
    # the same run: every step's figures equal, but for its clock
    for a, b in zip(slurm["steps"], local["steps"], strict=True):
        assert {k: v for k, v in a.items() if not TIMINGS.search(k)} == \
            {k: v for k, v in b.items() if not TIMINGS.search(k)}, (a, b)
    assert [s["step"] for s in slurm["steps"]] == [-1, 0, 1, 2]
    summary = slurm["summary"]
    assert summary["final_eval_reward"] > summary["untrained_eval_reward"], summary
    # nothing behind: the job ended, its processes and the procs gone, no /dev/shm file
    assert slurm["job"] and slurm_cluster.queue() == []
    assert left_of(slurm["job"]) == []
    for run in (slurm, local):
        assert run["alive"] == [] and run["shm"] == [], run
