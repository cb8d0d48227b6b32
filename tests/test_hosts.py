"""start_hosts for each scheduler, for real: local, processes, torchx local_cwd, a Monarch job
object; dry runs for slurm and kubernetes; gpus_per_host without a GPU."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import psutil
import pytest
from monarch.actor import Actor, endpoint

from colocate.resources.gpus import gpus_per_host
from colocate.resources.host_job import HostJob, HostStartError
from colocate.resources.hosts import start_hosts
from colocate.resources.torchx_hosts import dryrun_torchx


@pytest.fixture(autouse=True, scope="module")
def _procs_import_this_module():
    """Procs unpickle the Pid actor by its module: let them import it (they inherit the env)."""
    saved = os.environ.get("PYTHONPATH")
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, saved) if p)
    yield
    if saved is None:
        os.environ.pop("PYTHONPATH")
    else:
        os.environ["PYTHONPATH"] = saved


class Pid(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()


def _pids(job: HostJob, per_host: int = 2, stop: bool = False) -> list[int]:
    """The pids of a Pid actor on `per_host` procs per host (procs stopped after, if `stop`)."""
    procs = job.mesh.spawn_procs(per_host={"gpus": per_host})
    try:
        actor = procs.spawn("pid", Pid)
        return sorted(pid for _, pid in actor.pid.call().get(timeout=60))
    finally:
        if stop:
            procs.stop().get(timeout=30)


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _wait_gone(pids: list[int], within_s: float = 5.0) -> list[int]:
    end = time.monotonic() + within_s
    while _alive(pids) and time.monotonic() < end:
        time.sleep(0.1)
    return _alive(pids)


def _worker_pids() -> list[int]:
    """Live `colocate.resources.worker` processes started by this test process."""
    pids = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "colocate.resources.worker" in " ".join(p.cmdline()) and _alive([p.pid]):
                pids.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


def test_local_is_this_host():
    with start_hosts("local") as job:
        assert (job.scheduler, job.num_hosts) == ("local", 1)
        pids = _pids(job, stop=True)  # the host is this one: stop the procs we started
        assert len(set(pids)) == 2 and os.getpid() not in pids
    assert _wait_gone(pids) == []


def test_local_refuses_several_hosts():
    with pytest.raises(ValueError, match='"processes"'):
        start_hosts("local", hosts=2)


@pytest.mark.timeout(180)
def test_processes_two_hosts():
    job = start_hosts("processes", hosts=2)
    try:
        assert (job.scheduler, job.num_hosts, len(job.mesh)) == ("processes", 2, 2)
        pids = _pids(job)
        assert len(set(pids)) == 4
    finally:
        job.stop()
    assert _wait_gone(pids) == []
    job.stop()  # idempotent


@pytest.mark.timeout(180)
def test_torchx_local_cwd_two_hosts():
    started = time.monotonic()
    job = start_hosts("torchx:local_cwd", hosts=2, timeout_s=60)
    try:
        up_s = time.monotonic() - started
        assert (job.scheduler, job.num_hosts) == ("torchx:local_cwd", 2)
        assert job.handle and job.handle.startswith("local_cwd://")
        assert job.logs and os.path.isdir(job.logs)
        workers = _worker_pids()
        assert len(workers) == 2
        pids = _pids(job)
        assert len(set(pids)) == 4
        assert all(psutil.Process(p).ppid() in workers for p in pids)
        print(f"torchx:local_cwd 2 hosts up in {up_s:.1f} s")
    finally:
        job.stop()
    assert _wait_gone(pids + workers) == []
    assert not os.path.exists(job.logs)  # the temporary log dir goes with the hosts


@pytest.mark.timeout(180)
def test_torchx_stop_without_grace_cancels_the_app():
    job = start_hosts("torchx:local_cwd", hosts=1)
    try:
        workers = _worker_pids()
        pids = _pids(job, per_host=1)
    finally:
        job.stop(grace_s=0)  # no graceful shutdown: runner.cancel() ends them
    assert len(workers) == 1 and _wait_gone(pids + workers) == []


@pytest.mark.timeout(180)
def test_torchx_worker_failure_names_app_and_logs():
    bad_rank = {"MONARCH_SERVICE_PROC_RANK": "7"}  # past the list: every worker fails at start
    with pytest.raises(HostStartError) as failed:
        start_hosts("torchx:local_cwd", hosts=2, timeout_s=60, env=bad_rank)
    err = failed.value
    try:
        assert "torchx:local_cwd" in str(err) and err.handle and err.handle in str(err)
        assert err.logs and err.logs in str(err)
        with open(os.path.join(err.logs, "0", "stderr.log")) as f:
            assert "IndexError" in f.read()
        assert _worker_pids() == []
    finally:
        if err.logs:  # <log_dir>/<session>/<app id>/hosts: a temporary log_dir, kept for us
            shutil.rmtree(Path(err.logs).parents[2], ignore_errors=True)


@pytest.mark.timeout(180)
def test_monarch_job_object_by_mesh_name():
    from monarch.job import ProcessJob

    with start_hosts(ProcessJob({"trainers": 2, "gens": 1}), mesh_name="gens") as job:
        assert (job.scheduler, job.num_hosts) == ("ProcessJob", 1)
        pids = _pids(job, per_host=1)
    assert _wait_gone(pids) == []


def test_dryrun_slurm():
    info = dryrun_torchx("slurm", 2, partition="gpu")
    text = str(info)
    assert "python -m colocate.resources.worker --port-base 26600" in text
    # torchx runs the replicas as one heterogeneous sbatch job: one component per replica
    assert "#SBATCH --job-name=hosts-0" in text and "#SBATCH --job-name=hosts-1" in text
    assert "hosts-2" not in text and "--partition=gpu" in text
    assert "MONARCH_SERVICE_PROC_RANK=0" in text and "MONARCH_SERVICE_PROC_RANK=1" in text


def test_dryrun_kubernetes():
    pytest.importorskip("kubernetes")  # torchx's kubernetes scheduler needs the client
    info = dryrun_torchx("kubernetes", 2, image="ghcr.io/example/colocate:latest", queue="default")
    text = str(info)
    assert "colocate.resources.worker" in text and "ghcr.io/example/colocate:latest" in text
    # a Volcano job with one task per replica
    tasks = info.request.resource["spec"]["tasks"]
    assert [t["name"] for t in tasks] == ["hosts-0", "hosts-1"]
    assert "MONARCH_SERVICE_PROC_RANK" in text
    with pytest.raises(ValueError, match="image="):
        dryrun_torchx("kubernetes", 2, queue="default")


def test_unknown_scheduler_names_the_accepted_ones():
    for bad in ("torchx:", "nope", 42):
        with pytest.raises(ValueError, match='"local", "processes", "slurm", "torchx:<scheduler>"'):
            start_hosts(bad)


def test_gpus_per_host_is_zero_without_gpu():
    assert gpus_per_host() == 0
