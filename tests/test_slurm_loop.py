"""The RL loop on two hosts of a real Slurm cluster (the `slurm_cluster` fixture, three
nodes): a short run of the default task (a tiny model, a few steps) learns, runs on both
nodes with the generator on the trainer's procs, and equals step by step the same run,
same seed, on two "processes" hosts. A host lost mid-run (its Slurm task killed, or its
node set down) is seen within seconds and named; the run gets new hosts from Slurm (the
third node) and ends equal to the run never faulted; with no node to replace it within
`run.host_timeout_s` the run stops naming what it waited for, and `run.resume=auto` on a
new allocation finishes it. Nothing is left behind: no Slurm job, no process of a job, no
/dev/shm file of the run's procs.

Each run is its own fresh process (`isolated`): attaching to Slurm's workers sets Monarch's
transport for the whole process.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import run_isolated
from slurm_cluster import left_of

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]
SHM = Path("/dev/shm")
# a short run: enough steps for the rewards to move, each step a second or two; a fault at
# step FAULT_AT goes back to the checkpoint of step 2
SHORT = ["run.steps=5", "run.eval_every=5", "run.save_every=2", "grpo.prompts_per_step=8",
         "task.eval_size=16", "run.cpu_threads=1", "run.hosts=2"]
FAULT_AT = 3
TIMINGS = re.compile(r"(_s|_share|per_s)$")  # a step's clock: differs from run to run
# the most a slot held after a switch so far: on new hosts it counts from their start
RUNNING_MAX = {"slot_peak_bytes"}


def _node(pid: int) -> str:
    """The Slurm node a proc runs on ("" outside Slurm): its SLURMD_NODENAME."""
    try:
        return psutil.Process(pid).environ().get("SLURMD_NODENAME", "")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "?"


def _shm_files() -> set[str]:
    return {str(p) for p in SHM.iterdir()} if SHM.is_dir() else set()


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
    raise AssertionError(f"no worker of job {job} on its node {node_id}")


async def _run(out: str, scheduler: str, fault: str | None, extra: list[str]
               ) -> dict[str, Any]:
    from examples.rl_loop.config import load_config
    from examples.rl_loop.hooks import Hooks
    from examples.rl_loop.loop import Loop
    from examples.rl_loop.memory import tenant_infos

    class Watch(Hooks):
        """Where each service runs once it is up (pid, node); the fault, as step FAULT_AT
        generates: host 1's Slurm task killed ("kill") or its node set down ("down")."""

        procs: dict[str, list[tuple[int, str]]] = {}
        pids: set[int] = set()
        jobs: list[str] = []
        index, fault_at, node = -1, 0.0, ""

        async def started(self) -> None:
            await self.record()

        async def record(self) -> None:
            self.jobs.append(self.loop.runtime.rm.job.handle or "")
            for name, service in self.loop.runtime.services().items():
                self.procs[name] = sorted((i.pid, _node(i.pid))
                                          for i in await tenant_infos(service))
                self.pids.update(pid for pid, _ in self.procs[name])

        async def step_began(self, index: int) -> None:
            self.index = index

        async def phase(self, label: str) -> None:
            if fault and label == "generate" and self.index == FAULT_AT and not self.fault_at:
                job = self.loop.runtime.rm.job
                self.node, self.fault_at = job.nodes[1], time.time()
                if fault == "kill":
                    for proc in _task_of(job.handle, "1"):
                        proc.send_signal(signal.SIGKILL)
                else:
                    subprocess.run(["scontrol", "update", f"NodeName={self.node}",
                                    "State=DOWN", "Reason=colocate-test"], check=True)

        async def loading(self, checkpoint: Path | None) -> None:
            await self.record()  # the new hosts' procs

    cfg = load_config(overrides=[*SHORT, f"run.scheduler={scheduler}", f"run.out={out}",
                                 *extra])
    before = _shm_files()
    hooks = Watch()
    loop = Loop(cfg, hooks=hooks)
    failed = ""
    try:
        summary = await loop.run()
    except Exception as err:
        summary, failed = {}, f"{type(err).__name__}: {err}"
    named = re.compile(r"(?<!\d)(" + "|".join(map(str, sorted(hooks.pids))) + r")(?!\d)")
    metrics = json.loads((Path(out) / "metrics.json").read_text())
    return {"summary": summary, "failed": failed, "procs": hooks.procs,
            "jobs": [j for j in hooks.jobs if j], "fault_at": hooks.fault_at,
            "faulted_node": hooks.node, "restarts": metrics["restarts"],
            "alive": [p for p in hooks.pids if psutil.pid_exists(p)
                      and psutil.Process(p).status() != psutil.STATUS_ZOMBIE],
            "shm": sorted(f for f in _shm_files() - before if named.search(Path(f).name)),
            "steps": metrics["steps"]}


def run_loop(out: str, scheduler: str, fault: str | None = None,
             extra: tuple[str, ...] = ()) -> dict[str, Any]:
    return asyncio.run(_run(out, scheduler, fault, list(extra)))


@pytest.fixture(scope="module")
def never_faulted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The run on two "processes" hosts, start to end."""
    return run_isolated(run_loop, str(tmp_path_factory.mktemp("processes")), "processes")


def _same_steps(run: dict[str, Any], reference: dict[str, Any]) -> None:
    """Every step's figures equal, but for its clock (and the running maximum)."""
    def figures(steps: list[dict]) -> list[dict]:
        return [{k: v for k, v in s.items() if not TIMINGS.search(k) and k not in RUNNING_MAX}
                for s in steps]

    assert figures(run["steps"]) == figures(reference["steps"])
    assert [s["step"] for s in run["steps"]] == list(range(-1, 5))


def _resume(nodes: tuple[str, ...]) -> None:
    """Nodes set down or drained by a test back in service (one at a time: Slurm refuses
    a RESUME of a node that is up, and with it the whole list)."""
    for node in nodes:
        subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"],
                       capture_output=True)


def _nothing_left(cluster: Any, *runs: dict[str, Any]) -> None:
    assert cluster.queue() == []
    for run in runs:
        for job in run["jobs"]:
            assert left_of(job) == [], job
        assert run["alive"] == [] and run["shm"] == [], run


def test_two_slurm_hosts_run_the_loop_as_two_processes_hosts_do(slurm_cluster, isolated,
                                                                never_faulted, tmp_path):
    slurm = isolated(run_loop, str(tmp_path), "slurm")
    # on two nodes, the generator in the trainer's procs: one replica per slot
    trainer, generator = slurm["procs"]["trainer"], slurm["procs"]["generator"]
    nodes = [node for _, node in trainer]
    assert len(set(nodes)) == 2 and set(nodes) <= set(slurm_cluster.nodes), trainer
    assert generator == trainer
    assert never_faulted["procs"]["generator"] == never_faulted["procs"]["trainer"]
    assert len(never_faulted["procs"]["trainer"]) == 2
    _same_steps(slurm, never_faulted)
    summary = slurm["summary"]
    assert summary["final_eval_reward"] > summary["untrained_eval_reward"], summary
    _nothing_left(slurm_cluster, slurm, never_faulted)


@pytest.mark.parametrize("fault", ["kill", "down"])
def test_a_lost_slurm_host_is_named_replaced_and_the_run_ends_as_never_faulted(
        slurm_cluster, isolated, never_faulted, tmp_path, fault):
    try:
        run = isolated(run_loop, str(tmp_path), "slurm", fault)
    finally:
        _resume(slurm_cluster.nodes)
    assert run["failed"] == "" and len(run["restarts"]) == 1, run
    restart, (old, new) = run["restarts"][0], run["jobs"]
    lost = f"host 1 (Slurm job {old}, node {run['faulted_node']}"
    assert restart["cause"].startswith(f"lost {lost}"), restart
    if fault == "down":
        assert "Slurm says the node is down" in restart["cause"], restart
    assert restart["lost_at"] - run["fault_at"] < 5, restart  # seen within seconds
    assert restart["resumed_at"] == 2 and restart["step"] == FAULT_AT
    # the new hosts: a new job, without the lost node
    nodes = {node for _, node in run["procs"]["trainer"]}
    assert new != old and len(nodes) == 2 and run["faulted_node"] not in nodes, run["procs"]
    _same_steps(run, never_faulted)
    _nothing_left(slurm_cluster, run)


def test_without_a_node_to_replace_it_the_run_stops_and_resumes_on_a_new_allocation(
        slurm_cluster, isolated, never_faulted, tmp_path):
    """The third node is drained: a lost host has no replacement within
    run.host_timeout_s; the error names the host and what it waited for, and
    run.resume=auto finishes the run once the nodes are back."""
    try:
        subprocess.run(["scontrol", "update", f"NodeName={slurm_cluster.nodes[2]}",
                        "State=DRAIN", "Reason=colocate-test"], check=True)
        stopped = isolated(run_loop, str(tmp_path), "slurm", "kill",
                           ("run.host_timeout_s=8",))
    finally:
        _resume(slurm_cluster.nodes)
    failed = stopped["failed"]
    assert failed.startswith(f"HostsLostError: lost host 1 (Slurm job {stopped['jobs'][0]}, "
                             f"node {stopped['faulted_node']}"), failed
    assert re.search(r"no replacement within run.host_timeout_s=8 s: slurm: job \d+ still "
                     r"PENDING after 8 s \(reason: [^)]+\)", failed), failed
    assert "\n" not in failed
    _nothing_left(slurm_cluster, stopped)
    resumed = isolated(run_loop, str(tmp_path), "slurm", None, ("run.resume=auto",))
    assert resumed["failed"] == "", resumed["failed"]
    _same_steps(resumed, never_faulted)
    _nothing_left(slurm_cluster, resumed)
