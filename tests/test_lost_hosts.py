"""Lost hosts without a cluster: how a lost host is named, which host counts as lost first
when Monarch fails every host's arbiter at once, what it fails, and the run's host fields
(`run.hosts`, `run.scheduler`, `run.host_timeout_s`) refused in one line each. The real
losses, on a Slurm cluster, are `test_slurm_loop.py`'s."""

from __future__ import annotations

import pytest

from colocate.resources.faults import Faults
from colocate.resources.host_job import HostJob
from colocate.resources.lost_hosts import HostLostError, LostHosts
from examples.rl_loop.config import load_config


def slurm_job(dead: set[int]) -> HostJob:
    return HostJob(mesh=None, scheduler="processes-like", num_hosts=3, handle="41005",
                   nodes=("c1n1", "c1n2", "c1n3"), _answers=lambda host: host not in dead)


def test_a_lost_host_is_named_and_fails_the_spawns_on_it():
    faults = Faults()
    failed: list[tuple[str, str]] = []
    faults.listeners.append(type("W", (), {"failed": lambda self, n, w: failed.append((n, w))})())
    for name, procs in (("trainer", ((0, 10), (1, 11))), ("gen0", ((0, 10),)),
                        ("gen1", ((1, 11),))):
        faults.reserve(name)
        faults.track(name, f"mesh_{name}", procs)
    job = HostJob(mesh=None, scheduler="processes", num_hosts=2)
    lost = LostHosts(job, faults)
    lost.add(1, "its arbiter stopped answering (SupervisionError)")
    lost.add(1, "again")  # the first report counts
    assert [h.name for h in lost.lost.values()] == ["host 1 (processes)"]
    assert sorted(n for n, _ in failed) == ["gen1", "trainer"]
    assert all(w == "host 1 (processes) was lost (its arbiter stopped answering "
               "(SupervisionError))" for _, w in failed)
    with pytest.raises(HostLostError, match=r"^group 'rl': host 1 \(processes\) lost \(its "
                       r"arbiter stopped answering \(SupervisionError\)\); the run needs a "
                       r"new allocation$"):
        lost.check([0, 1], "group 'rl'")
    lost.check([0], "group 'rl'")  # host 0 is fine


def test_the_host_whose_worker_is_gone_counts_as_lost_first():
    """Monarch fails a mesh whole: host 0's arbiter may be reported first although host 1's
    worker died; the job's probe of the workers puts host 1 first (its node is left out of
    the next allocation)."""
    job = slurm_job(dead={1})
    lost = LostHosts(job, Faults())
    lost.add(0, "its arbiter stopped answering (SupervisionError)")
    assert [(h.host, h.node) for h in lost.lost.values()] == [(1, "c1n2"), (0, "c1n1")]
    assert lost.nodes()[:1] == ["c1n2"]
    assert lost.lost[1].why == "its worker does not take connections"


@pytest.mark.parametrize("override, message", [
    ("run.hosts=0", "run.hosts=0: must be >= 1"),
    ("run.scheduler=kubernetes", "run.scheduler='kubernetes': use one of ('local', "
     "'processes', 'slurm') or torchx:<scheduler> (torchx:local_cwd, torchx:slurm...)"),
    ("run.hosts=2", "run.hosts=2 with run.scheduler=local, which is this one host: give "
     "run.scheduler=processes (local hosts) or slurm"),
    ("run.host_timeout_s=0", "run.host_timeout_s=0.0: must be > 0"),
])
def test_the_host_fields_are_refused_in_one_line(override, message):
    with pytest.raises(ValueError) as err:
        load_config(overrides=[override])
    assert str(err.value) == message


def test_the_host_fields_accepted():
    run = load_config(overrides=["run.hosts=2", "run.scheduler=torchx:local_cwd",
                                 "run.host_timeout_s=30"]).run
    assert (run.hosts, run.scheduler, run.host_timeout_s) == (2, "torchx:local_cwd", 30.0)
