"""The `slurm_cluster` fixture: a real Slurm cluster on this machine for the tests marked
`slurm`, started once per session by `tests/slurm/local_cluster.sh` (munged, slurmctld and
three slurmd nodes, each with its own name and loopback address) and stopped at the end with
everything its jobs started.

Where Slurm cannot run here (not root, the packages missing, no UTS namespaces) the tests
are skipped with the reason; under CI (`CI=true`) they fail instead, so a CI machine that
lost Slurm is seen.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

SCRIPT = Path(__file__).parent / "slurm" / "local_cluster.sh"
NODES = 3  # runs take 2 hosts: the third is there to replace a lost one
PACKAGES = "apt-get install slurmctld slurmd slurm-client munge"


@dataclass(frozen=True)
class SlurmCluster:
    conf: str  # its slurm.conf (SLURM_CONF for every client)
    dir: Path  # its state, logs and munge key
    nodes: tuple[str, ...]  # the node names, as squeue and the jobs see them

    def queue(self) -> list[str]:
        """The jobs Slurm lists now, one `id state nodes` line each."""
        out = subprocess.run(["squeue", "-h", "-o", "%i %T %N"], capture_output=True,
                             text=True, check=True).stdout
        return out.splitlines()


def job_processes(job_id: str) -> list[str]:
    """Live processes (not zombies) started by Slurm job `job_id`, as `pid cmdline`."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if (p.info["status"] != psutil.STATUS_ZOMBIE
                    and p.environ().get("SLURM_JOB_ID") == job_id):
                found.append(f"{p.pid} {' '.join(p.info['cmdline'] or [])}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def left_of(job_id: str, within_s: float = 10.0) -> list[str]:
    """The processes of job `job_id` still alive after `within_s` (they end as it ends)."""
    end = time.monotonic() + within_s
    while (left := job_processes(job_id)) and time.monotonic() < end:
        time.sleep(0.2)
    return left


def why_not() -> str | None:
    """Why a local Slurm cluster cannot run on this machine, or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "starting slurmctld/slurmd/munged needs root"
    missing = [c for c in ("munged", "slurmctld", "slurmd", "sinfo", "sbatch", "unshare")
               if shutil.which(c) is None]
    if missing:
        return f"{', '.join(missing)} not found: {PACKAGES} (.ci/run does)"
    probe = subprocess.run(["unshare", "--uts", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"no UTS namespaces for the slurmd nodes (unshare --uts: {probe.stderr.strip()})"
    return None


def _skip_or_fail(why: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI must run the slurm tests: {why}", pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """The running cluster, its SLURM_CONF set in os.environ for the session."""
    why = why_not()
    if why:
        _skip_or_fail(why)
    root = tmp_path_factory.mktemp("slurm")
    started = subprocess.run(["bash", str(SCRIPT), "start", str(root), str(NODES)],
                             capture_output=True, text=True, timeout=120)
    if started.returncode != 0:
        _skip_or_fail(f"the local Slurm cluster did not start ({SCRIPT.name} exit "
                      f"{started.returncode}): {started.stderr.strip()[-2000:]}")
    conf = started.stdout.strip().split("SLURM_CONF=")[-1]
    saved = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    try:
        names = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True,
                               text=True, check=True).stdout.split()
        yield SlurmCluster(conf, root, tuple(sorted(set(names))))
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", str(root)], capture_output=True,
                       timeout=120)
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved
