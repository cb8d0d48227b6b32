"""Hosts from a real Slurm cluster (the `slurm_cluster` fixture: munged, slurmctld and three
slurmd nodes on this machine): `start_hosts("slurm", n)`, what it says when Slurm refuses or
queues the job, what `stop()` leaves (nothing), and the runtime over two Slurm hosts:
packing, colocation, one arbiter per host, sleep/wake and awake-only routing, with a
resource group spanning both hosts and one per host.

Each scenario that attaches to the workers runs in a fresh process (`isolated`): attaching
sets Monarch's transport for the whole process, which the other tests of this worker must
not inherit.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import time
from typing import Any

import pytest
from monarch.actor import Actor, endpoint
from slurm_cluster import job_processes, left_of

from colocate.resources.host_job import HostStartError
from colocate.resources.hosts import start_hosts
from colocate.testing import MemoryTenant

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]
MiB = 1 << 20


class Where(Actor):
    @endpoint
    def where(self) -> tuple[str, int]:
        return socket.gethostname(), os.getpid()


class HostTenant(MemoryTenant):
    """A MemoryTenant that says which node and process it lives in."""

    @endpoint
    def where(self) -> tuple[str, int]:
        return socket.gethostname(), os.getpid()


def test_sbatch_refusal_and_a_queued_job_name_their_cause(slurm_cluster):
    with pytest.raises(HostStartError, match=r"sbatch refused the job of 2 nodes "
                       r"\(.*--partition=nope.*\): .*(?i:partition)"):
        start_hosts("slurm", 2, partition="nope")
    start = time.monotonic()
    with pytest.raises(HostStartError, match=r"slurm: job (\d+) still PENDING after 2 s "
                       r"\(reason: BeginTime\); cancelled") as info:
        start_hosts("slurm", 2, timeout_s=2, sbatch_args=("--begin=now+1hour",))
    assert time.monotonic() - start < 10
    assert info.value.handle and re.fullmatch(r"\d+", info.value.handle)
    assert slurm_cluster.queue() == []  # the queued job was cancelled


def two_hosts() -> dict[str, Any]:
    start = time.monotonic()
    job = start_hosts("slurm", 2, timeout_s=60)
    up_s = time.monotonic() - start
    procs = job.mesh.spawn_procs(per_host={"gpus": 2})
    where = sorted(v for _, v in procs.spawn("where", Where).where.call().get(timeout=60))
    queued = subprocess.run(["squeue", "-h", "-j", job.handle, "-o", "%T %N"],
                            capture_output=True, text=True).stdout.split()
    running = job_processes(job.handle)
    start = time.monotonic()
    job.stop()
    return {"up_s": up_s, "stop_s": time.monotonic() - start, "where": where,
            "job": job.handle, "queued": queued, "running": running,
            "job_processes_after_stop": left_of(job.handle)}


def test_two_hosts_from_slurm_and_stop_leaves_nothing(slurm_cluster, isolated,
                                                      procs_import_tests):
    got = isolated(two_hosts)
    assert got["queued"][0] == "RUNNING"
    hosts = sorted({host for host, _ in got["where"]})  # two of the cluster's nodes
    assert len(hosts) == 2 and set(hosts) <= set(slurm_cluster.nodes), hosts
    assert len({pid for _, pid in got["where"]}) == 4  # 2 procs on each node
    assert len(got["running"]) >= 2 + 4, got["running"]  # 2 workers, 4 procs at least
    assert got["job_processes_after_stop"] == []
    assert slurm_cluster.queue() == []
    assert got["up_s"] < 30 and got["stop_s"] < 30, got


async def _runtime_on_slurm() -> dict[str, Any]:
    from colocate import phase
    from colocate.resources.start import init
    from services import ServiceConfig, spawn_service

    rm = await init("slurm", hosts=2, gpus_per_host=2, timeout_s=60)
    out: dict[str, Any] = {}
    try:
        arbiters = rm.arbiter_procs.spawn("where", Where)
        out["arbiter_hosts"] = sorted(h for _, (h, _) in (await arbiters.where.call()).items())
        # a group spanning both hosts (one replica of 2 hosts x 1 proc), two tenants in it
        wide = ServiceConfig(hosts_per_replica=2, procs_per_host=1, resource_group="wide")
        trainer = await spawn_service(wide, HostTenant, 8, 1, name="trainer")
        generator = await spawn_service(wide, HostTenant, 8, 2, name="generator")
        # groups of one host each: the packing puts them on the slot each host has left
        local = [await spawn_service(ServiceConfig(procs_per_host=1), HostTenant, 8, 3,
                                     name=f"local{i}") for i in range(2)]
        services = {"trainer": [trainer], "generator": [generator], "local": local}
        out["slots_by_tenant"] = {t: sorted(rm.slots_of(t)) for group in services.values()
                                  for svc in group for t in svc.tenant_names()}
        places = {}
        for name, group in services.items():
            places[name] = sorted([v for svc in group for r in svc.replicas
                                   for _, v in (await r.actors.where.call()).items()])
        out["places"] = places
        # sleep/wake on both hosts, the release measured in each proc
        async with phase(trainer):
            before = [v for r in trainer.replicas
                      for _, v in (await r.actors.memory.call()).items()]
        await rm.sleep(trainer.tenant_names()[0])  # nothing awake on slot 0 of each host
        asleep = [v for r in trainer.replicas for _, v in (await r.actors.memory.call()).items()]
        async with phase(generator):
            out["status_generator_phase"] = await rm.status()
        out["released"] = [b["used"] - a["used"] for b, a in zip(before, asleep, strict=True)]
        # awake-only routing while the two tenants of the spanning group take turns
        stop = asyncio.Event()

        async def alternate() -> None:
            while not stop.is_set():
                for svc in (generator, trainer):
                    async with phase(svc):
                        await asyncio.sleep(0.05)

        switching = asyncio.create_task(alternate())
        results = await asyncio.gather(*(generator.work.route(i) for i in range(60)),
                                       *(trainer.work.route(100 + i) for i in range(30)))
        stop.set()
        await switching
        out["routed"] = list(results)
        out["counts"] = [c for svc in (generator, trainer) for r in svc.replicas
                         for _, c in (await r.actors.counts.call()).items()]
    finally:
        await rm.shutdown()
    return out


def runtime_on_slurm() -> dict[str, Any]:
    return asyncio.run(_runtime_on_slurm())


def test_runtime_over_two_slurm_hosts(slurm_cluster, isolated, procs_import_tests):
    got = isolated(runtime_on_slurm)
    nodes = got["arbiter_hosts"]  # one arbiter per host, each on its node
    assert len(set(nodes)) == 2 and set(nodes) <= set(slurm_cluster.nodes), nodes
    trainer, generator, local = got["places"]["trainer"], got["places"]["generator"], \
        got["places"]["local"]
    assert trainer == generator  # colocated: the same procs, on both nodes
    assert sorted(h for h, _ in trainer) == nodes
    assert sorted(h for h, _ in local) == nodes  # one replica per host
    assert not {p for _, p in local} & {p for _, p in trainer}  # its own procs
    by_tenant = got["slots_by_tenant"]
    spanning = [s for t, s in by_tenant.items() if t.startswith(("trainer", "generator"))]
    assert all(s == [(0, 0), (1, 0)] for s in spanning), by_tenant  # packed on slot 0
    assert sorted(s for t, s in by_tenant.items() if t.startswith("local")) == \
        [[(0, 1)], [(1, 1)]], by_tenant
    assert all(r >= 0.9 * 2 * 8 * MiB for r in got["released"]), got["released"]
    status = got["status_generator_phase"]
    assert sorted(status) == [0, 1]
    for host in (0, 1):
        awake = [t for t, stages in status[host][0].items() if stages]
        assert len(awake) == 1 and awake[0].startswith("generator"), status
    assert got["routed"] == list(range(60)) + [100 + i for i in range(30)]
    assert all(c["asleep"] == 0 for c in got["counts"]), got["counts"]
    assert slurm_cluster.queue() == []
