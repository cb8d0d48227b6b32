"""Hosts from Slurm: `start_hosts("slurm", n)` allocates n nodes with `sbatch` and attaches
one Monarch host per node.

Two launches, picked by the cluster's Slurm version (``sinfo --version``):

* The project's own (any Slurm with sbatch/squeue/scontrol/scancel): one batch job of
  ``--nodes=n --ntasks-per-node=1`` whose script runs ``srun`` of
  ``python -m colocate.resources.worker --slurm`` on every node. Each worker serves
  ``tcp://$SLURMD_NODENAME:<port>`` with the service identity of rank ``$SLURM_NODEID``;
  the client waits for the job to run, takes its nodes from ``squeue -h -j ID -o %N`` and
  ``scontrol show hostnames``, and attaches with ``attach_to_workers``. It is used below
  Slurm 23.11 because Monarch's ``SlurmJob`` reads ``squeue --job ID --json`` expecting
  Slurm 23.11's layout: 22.05 (Debian bookworm's) does not filter that output by job and
  gives ``job_resources.nodes.allocation`` as a string, so ``SlurmJob`` fails there.
* Monarch's ``SlurmJob`` from 23.11 on (or with ``launcher="monarch"``), through the same
  options; its hosts are attached by ``job.state(cached_path=None)``.

The port: ``26600 + job id % 1000`` unless ``port=`` is given, so that two jobs sharing a
node (``OverSubscribe``) do not collide. The worker (and so the project) must be at the
same path on every node, with the same Python (``python=``, default this interpreter): a
shared file system, as usual on a Slurm cluster. The job inherits this process's
environment (sbatch's default ``--export=ALL``), and ``PYTHONPATH`` gets the project's root.

``stop()`` shuts the mesh down, then ``scancel``s the job and waits until Slurm no longer
lists it. A worker that dies leaves the others running (``srun --kill-on-bad-exit=0``), so
the client can tell which host it lost (``HostJob.answers``: does the node's worker still
take connections); a node set down ends the job on every node. Either way the client's
meshes fail whole, and a run comes back with a new allocation.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from colocate.resources.host_job import HostJob, HostStartError, wait_initialized

logger = logging.getLogger(__name__)

WORKER_MODULE = "colocate.resources.worker"
BASE_PORT = 26600  # as Monarch's serve(); plus the job id modulo 1000
MONARCH_SLURM_MIN = (23, 11)  # the squeue --json layout Monarch's SlurmJob reads
LAUNCHERS = ("auto", "own", "monarch")


def slurm_version() -> tuple[int, int] | None:
    """The cluster's Slurm (major, minor) from ``sinfo --version``; None without Slurm."""
    if shutil.which("sinfo") is None:
        return None
    out = subprocess.run(["sinfo", "--version"], capture_output=True, text=True).stdout
    found = re.search(r"(\d+)\.(\d+)", out)
    return (int(found[1]), int(found[2])) if found else None


def start_slurm(n: int, timeout_s: float, *, launcher: str = "auto",
                partition: str | None = None, time_limit: str | None = None,
                gpus_per_node: int | None = None, cpus_per_task: int | None = None,
                mem: str | None = None, exclusive: bool = False,
                sbatch_args: tuple[str, ...] = (), python: str | None = None,
                port: int | None = None, log_dir: str | None = None,
                job_name: str = "colocate-hosts") -> HostJob:
    """Allocate `n` nodes with sbatch and return their hosts once all answer, or raise
    HostStartError (the job cancelled) after `timeout_s`, queueing included."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher={launcher!r}; accepted: {', '.join(LAUNCHERS)}")
    missing = [c for c in ("sbatch", "squeue", "scontrol", "scancel") if shutil.which(c) is None]
    if missing:
        raise HostStartError(f"slurm: {', '.join(missing)} not found on PATH: run on a Slurm "
                             "cluster's login node (or install slurm-client and set SLURM_CONF)")
    version = slurm_version()
    if launcher == "monarch" or (launcher == "auto" and version is not None
                                 and version >= MONARCH_SLURM_MIN):
        return _start_monarch(n, timeout_s, partition=partition, time_limit=time_limit,
                              gpus_per_node=gpus_per_node, cpus_per_task=cpus_per_task,
                              mem=mem, exclusive=exclusive, sbatch_args=sbatch_args,
                              python=python, port=port, log_dir=log_dir, job_name=job_name)
    directives = _directives(n, job_name, partition, time_limit, gpus_per_node, cpus_per_task,
                             mem, exclusive, sbatch_args)
    return SlurmLaunch(n, directives, python or sys.executable, port, log_dir).start(timeout_s)


def _directives(n: int, job_name: str, partition: str | None, time_limit: str | None,
                gpus_per_node: int | None, cpus_per_task: int | None, mem: str | None,
                exclusive: bool, sbatch_args: tuple[str, ...]) -> list[str]:
    # never requeued: a requeued job would start its workers again under the same ids,
    # and the client would take them for the hosts it lost
    lines = [f"--job-name={job_name}", f"--nodes={n}", "--ntasks-per-node=1", "--no-requeue"]
    for flag, value in (("partition", partition), ("time", time_limit),
                        ("gpus-per-node", gpus_per_node), ("cpus-per-task", cpus_per_task),
                        ("mem", mem)):
        if value is not None:
            lines.append(f"--{flag}={value}")
    if exclusive:
        lines.append("--exclusive")
    return lines + list(sbatch_args)


class SlurmLaunch:
    """One batch job of `n` workers: submit it, wait for its nodes and their workers, and
    cancel it when they do not come up or when the HostJob stops."""

    def __init__(self, n: int, directives: list[str], python: str, port: int | None,
                 log_dir: str | None) -> None:
        self.n, self.directives, self.python, self.port = n, directives, python, port
        self.own_logs = log_dir is None
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="colocate_slurm_")
        self.job_id = ""

    @property
    def output(self) -> str:
        return os.path.join(self.log_dir, f"slurm-{self.job_id or '%j'}.out")

    def script(self, proc_ids: list[Any]) -> str:
        from monarch.job import SERVICE_PROC_IDS_ENV, serialize_service_proc_ids

        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        port = (str(self.port) if self.port is not None
                else f"$(({BASE_PORT} + SLURM_JOB_ID % 1000))")
        ids = shlex.quote(serialize_service_proc_ids(proc_ids))
        lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in self.directives),
                 f"#SBATCH --output={self.output}", f"#SBATCH --chdir={os.getcwd()}",
                 f"export {SERVICE_PROC_IDS_ENV}={ids}",
                 f'export PYTHONPATH={shlex.quote(root)}"${{PYTHONPATH:+:$PYTHONPATH}}"',
                 f"exec srun --kill-on-bad-exit=0 --ntasks-per-node=1 {shlex.quote(self.python)}"
                 f" -m {WORKER_MODULE} --slurm --port-base {port}"]
        return "\n".join(lines) + "\n"

    def start(self, timeout_s: float) -> HostJob:
        from monarch.job import new_service_proc_id

        deadline = time.monotonic() + timeout_s
        proc_ids = [new_service_proc_id() for _ in range(self.n)]
        script = self.script(proc_ids)
        with open(os.path.join(self.log_dir, "sbatch.sh"), "w") as f:
            f.write(script)
        done = subprocess.run(["sbatch", "--parsable"], input=script, capture_output=True,
                              text=True)
        if done.returncode != 0:
            self._remove_logs()
            raise HostStartError(
                f"slurm: sbatch refused the job of {self.n} nodes ({' '.join(self.directives)}):"
                f" {done.stderr.strip() or done.stdout.strip()}")
        self.job_id = done.stdout.strip().split(";")[0]
        try:
            nodes = self._wait_running(deadline, timeout_s)
            port = self.port if self.port is not None else BASE_PORT + int(self.job_id) % 1000
            mesh = _attach([f"tcp://{node}:{port}" for node in nodes], proc_ids)
            wait_initialized(mesh, max(deadline - time.monotonic(), 1.0), "slurm",
                             self.output, self.job_id, self._check_running)
        except BaseException:
            self.cancel(remove_logs=False)
            raise
        logger.info("slurm: %d hosts up in job %s on %s", self.n, self.job_id, ",".join(nodes))
        return HostJob(mesh, "slurm", self.n, handle=self.job_id, logs=self.output,
                       nodes=tuple(nodes), _answers=lambda host: _listening(nodes[host], port),
                       _kill=lambda: self.cancel(remove_logs=True))

    def _state(self) -> tuple[str, str, str]:
        """(state, node list, reason) from squeue; ("", "", "") once Slurm forgot the job."""
        out = subprocess.run(["squeue", "-h", "-j", self.job_id, "-o", "%T|%N|%r"],
                             capture_output=True, text=True).stdout.strip()
        if not out:
            return "", "", ""
        state, nodes, reason = (out.splitlines()[0].split("|") + ["", ""])[:3]
        return state, nodes, reason

    def _wait_running(self, deadline: float, timeout_s: float) -> list[str]:
        while True:
            state, nodelist, reason = self._state()
            if state == "RUNNING" and nodelist:
                nodes = subprocess.run(["scontrol", "show", "hostnames", nodelist],
                                       capture_output=True, text=True, check=True).stdout.split()
                if len(nodes) != self.n:
                    raise self._error(f"running on {len(nodes)} nodes ({nodelist}), not {self.n}")
                return nodes
            if state not in ("PENDING", "CONFIGURING", "RUNNING"):
                raise self._error(f"ended before it ran ({state or 'gone from squeue'})")
            if time.monotonic() > deadline:
                raise self._error(f"still {state} after {timeout_s:.0f} s (reason: {reason}); "
                                  "cancelled: ask for fewer nodes, another partition, or a "
                                  "longer timeout_s")
            time.sleep(0.2)

    def _check_running(self) -> None:
        state, nodes, _ = self._state()
        if state != "RUNNING":
            raise self._error(f"ended before its hosts answered ({state or 'gone from squeue'}"
                              f"{', nodes ' + nodes if nodes else ''})")

    def _error(self, why: str) -> HostStartError:
        tail = ""
        try:
            with open(self.output) as f:
                tail = "".join(f.readlines()[-5:]).strip()
        except OSError:
            pass
        return HostStartError(f"slurm: job {self.job_id} {why} (worker logs: {self.output})"
                              + (f"; its last lines:\n{tail}" if tail else ""),
                              handle=self.job_id, logs=self.output)

    def cancel(self, remove_logs: bool) -> None:
        """scancel the job and wait (up to 30 s) until squeue no longer lists it running."""
        subprocess.run(["scancel", self.job_id], capture_output=True, text=True)
        end = time.monotonic() + 30
        while time.monotonic() < end and self._state()[0] not in ("", "COMPLETED",
                                                                   "CANCELLED", "FAILED"):
            time.sleep(0.2)
        if remove_logs:
            self._remove_logs()

    def _remove_logs(self) -> None:
        if self.own_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)


def _attach(workers: list[str], proc_ids: list[Any]) -> Any:
    """attach_to_workers with the TCP transport that remote workers can dial back on."""
    from monarch.actor import ChannelTransport, attach_to_workers
    from monarch.config import configure
    from monarch.job import service_proc_addrs

    # process-wide, as SlurmJob does; where this host's name resolves to loopback only
    # (a cluster on this one machine), Monarch refuses it and localhost is what nodes reach
    transport = (ChannelTransport.TcpWithHostname if _hostname_routable()
                 else ChannelTransport.TcpWithLocalhost)
    configure(default_transport=transport)
    return attach_to_workers(ca="trust_all_connections",
                             workers=service_proc_addrs(workers, proc_ids))


def _listening(node: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether a worker takes connections on `node`:`port` (refused or silent: it does not)."""
    try:
        with socket.create_connection((node, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _hostname_routable() -> bool:
    """Whether this host's name resolves to an address other nodes can dial (not loopback,
    not link-local), as Monarch's TcpWithHostname transport requires."""
    import ipaddress

    try:
        infos = socket.getaddrinfo(socket.gethostname(), None)
    except OSError:
        return False
    addrs = {ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos}
    return any(not (a.is_loopback or a.is_link_local) for a in addrs)


def _start_monarch(n: int, timeout_s: float, *, partition: str | None,
                   time_limit: str | None, gpus_per_node: int | None,
                   cpus_per_task: int | None, mem: str | None, exclusive: bool,
                   sbatch_args: tuple[str, ...], python: str | None, port: int | None,
                   log_dir: str | None, job_name: str) -> HostJob:
    """Monarch's SlurmJob with the same request; its hosts once they answer."""
    from monarch.job import SlurmJob

    job = SlurmJob({"hosts": n}, python_exe=python or sys.executable,
                   slurm_args=list(sbatch_args), monarch_port=port or BASE_PORT,
                   job_name=job_name, time_limit=time_limit, partition=partition,
                   log_dir=log_dir, exclusive=exclusive, gpus_per_node=gpus_per_node,
                   cpus_per_task=cpus_per_task, mem=mem, job_start_timeout=int(timeout_s))
    try:
        mesh = job.state(cached_path=None).hosts
        wait_initialized(mesh, timeout_s, "slurm (Monarch SlurmJob)", "the job's log_dir")
    except BaseException:
        job.kill()
        raise
    return HostJob(mesh, "slurm", n, logs=log_dir, _kill=job.kill)
