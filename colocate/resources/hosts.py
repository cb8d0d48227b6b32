"""Hosts: turn a scheduler choice into a Monarch HostMesh of N hosts, and stop it.

    job = start_hosts("torchx:local_cwd", hosts=2)
    procs = job.mesh.spawn_procs(per_host={"gpus": 2})
    ...
    job.stop()                      # or: with start_hosts(...) as job: ...

Schedulers and how each starts:

- ``"local"``: this process's own host, ``monarch.actor.this_host()``; one host only.
  Nothing is started, so ``stop()`` leaves it alone.
- ``"processes"``: N local hosts through ``monarch.job.ProcessJob({"hosts": N})``: each is a
  subprocess running ``run_worker_loop_forever`` on a unix socket (``ipc://``).
  ``stop()`` shuts the mesh down, then ``job.kill()`` (SIGTERM, then SIGKILL).
- ``"slurm"``: N nodes allocated by ``sbatch``, one host per node (see ``slurm_hosts``:
  the project's own launch, or Monarch's ``SlurmJob`` where the cluster's Slurm is new
  enough); options name the partition, time limit, GPUs per node, ... ``stop()`` shuts the
  mesh down, then ``scancel``s the job.
- ``"torchx:<scheduler>"``: a torchx app of N worker replicas (``local_cwd``, ``slurm``,
  ``kubernetes``, ...; see ``torchx_hosts``); ``stop()`` shuts the mesh down, then cancels
  the app. ``dryrun_torchx()`` shows the request (sbatch script, Volcano job) without
  submitting.
- a Monarch job object (``SlurmJob``, ``KubernetesJob``, ``ProcessJob``, any ``JobTrait``):
  ``job.state(cached_path=None)`` and its host mesh named ``mesh_name=`` (needed when the job
  has several); ``stop()`` shuts the mesh down, then ``job.kill()``.

GPU discovery (`gpus_per_host`, `visible_gpus`, `run_on_slot_gpu`) is `colocate.resources.gpus`;
the job object is `host_job`'s `HostJob`, the torchx launch `torchx_hosts`', the Slurm one
`slurm_hosts`'.
"""

from __future__ import annotations

from typing import Any

from colocate.resources.host_job import HostJob, wait_initialized
from colocate.resources.slurm_hosts import start_slurm
from colocate.resources.torchx_hosts import start_torchx

ACCEPTED = ('"local"', '"processes"', '"slurm"', '"torchx:<scheduler>"',
            "a Monarch job (JobTrait)")


def start_hosts(
    scheduler: str | object = "local",
    hosts: int | None = None,
    *,
    timeout_s: float = 60.0,
    **options: Any,
) -> HostJob:
    """Start `hosts` Monarch hosts (default 1) with `scheduler` (see the module docstring) and
    return them as a HostJob once they answer, or raise HostStartError after `timeout_s`."""
    if _is_monarch_job(scheduler):
        return _from_monarch_job(scheduler, hosts, timeout_s, **options)
    if not isinstance(scheduler, str):
        raise ValueError(f"unknown scheduler {scheduler!r}; accepted: {', '.join(ACCEPTED)}")
    n = 1 if hosts is None else hosts
    if n < 1:
        raise ValueError(f"hosts must be >= 1, got {n}")
    if scheduler == "local":
        _no_options(scheduler, options)
        if n != 1:
            raise ValueError(
                f'scheduler "local" is this one host; for {n} local hosts use "processes"'
            )
        from monarch.actor import this_host

        return HostJob(this_host(), "local", 1, _owns_hosts=False)
    if scheduler == "processes":
        return _start_processes(n, timeout_s, **options)
    if scheduler == "slurm":
        return start_slurm(n, timeout_s, **options)
    if scheduler.startswith("torchx:") and scheduler != "torchx:":
        return start_torchx(scheduler.removeprefix("torchx:"), n, timeout_s, **options)
    raise ValueError(f"unknown scheduler {scheduler!r}; accepted: {', '.join(ACCEPTED)}")


# --- processes ---------------------------------------------------------------------------


def _start_processes(n: int, timeout_s: float, env: dict[str, str] | None = None,
                     **options: Any) -> HostJob:
    from monarch.job import ProcessJob

    _no_options("processes", options)
    job = ProcessJob({"hosts": n}, env=env)
    try:
        mesh = job.state(cached_path=None).hosts
        logs = "the Monarch log, /tmp/$USER/monarch_log.log (ProcessJob drops worker output)"
        wait_initialized(mesh, timeout_s, "processes", logs)
    except BaseException:
        job.kill()
        raise
    return HostJob(mesh, "processes", n, _kill=job.kill)


# --- Monarch job objects ------------------------------------------------------------------


def _is_monarch_job(obj: object) -> bool:
    if isinstance(obj, str):  # a scheduler's name: "local" needs no monarch.job, which
        return False  # loads Monarch's web dashboard and with it flask
    from monarch.job import JobTrait

    if isinstance(obj, JobTrait):
        return True
    return callable(getattr(obj, "state", None)) and callable(getattr(obj, "kill", None))


def _from_monarch_job(job: Any, hosts: int | None, timeout_s: float,
                      mesh_name: str | None = None, cached_path: str | None = None,
                      **options: Any) -> HostJob:
    label = type(job).__name__
    _no_options(label, options)
    was_active = bool(getattr(job, "active", False))
    try:
        state = job.state(cached_path=cached_path)
        names = sorted(getattr(state, "_hosts", {}))  # JobState keeps its meshes by name there
        if mesh_name is None:
            if len(names) != 1:
                raise ValueError(f"{label} has meshes {names}: pass mesh_name= to pick one")
            mesh_name = names[0]
        try:
            mesh = getattr(state, mesh_name)
        except AttributeError:
            raise ValueError(f"{label} has no mesh {mesh_name!r}; it has {names}") from None
        n = len(mesh)
        if hosts is not None and hosts != n:
            raise ValueError(f"{label} mesh {mesh_name!r} has {n} hosts, not {hosts}")
        wait_initialized(mesh, timeout_s, label, "the job's own logs")
    except BaseException:
        if not was_active:  # we applied it: don't leave it running
            job.kill()
        raise
    return HostJob(mesh, label, n, _kill=job.kill)


# --- helpers -------------------------------------------------------------------------------


def _no_options(scheduler: str, options: dict[str, Any]) -> None:
    if options:
        raise ValueError(f"scheduler {scheduler} takes no options, got {sorted(options)}")
