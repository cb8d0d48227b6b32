"""setup_distributed on real Monarch procs: ranks, env seen by actors spawned after, and a gloo
all_reduce across the replica (one host x 2 procs, 2 hosts x 1 proc, 1 proc)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from monarch.actor import Actor, endpoint

from colocate.resources.packing import ResourceRequest
from colocate.testing import start_runtime
from services.distributed import setup_distributed

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("procs_import_tests")]

KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


class AllReduceProbe(Actor):
    """Records the torch.distributed env its proc had when it was spawned; sums ranks."""

    def __init__(self) -> None:
        self.env = {key: os.environ.get(key) for key in KEYS}
        self.pid = os.getpid()

    @endpoint
    def seen(self) -> dict[str, object]:
        return {"pid": self.pid, **self.env}

    @endpoint
    def all_reduce(self) -> dict[str, int]:
        dist.init_process_group("gloo")  # env:// from the proc's environment
        try:
            total = torch.tensor([dist.get_rank()], dtype=torch.int64)
            dist.all_reduce(total)
            return {"rank": dist.get_rank(), "world": dist.get_world_size(),
                    "sum": int(total.item())}
        finally:
            dist.destroy_process_group()


async def check_replica(rm, hosts: int, procs_per_host: int) -> None:
    alloc = await rm.allocate(ResourceRequest("dist", hosts=hosts,
                                              procs_per_host=procs_per_host), owner="x")
    master = await setup_distributed(alloc)
    world = hosts * procs_per_host
    assert master["MASTER_ADDR"] == "127.0.0.1"  # every proc is on this machine
    assert master["WORLD_SIZE"] == str(world) and int(master["MASTER_PORT"]) > 0
    probes = await rm.spawn("probe", AllReduceProbe, alloc)
    seen = {(dict(p).get("hosts", 0), dict(p)["gpus"]): v
            for p, v in (await probes.seen.call()).items()}
    assert len({v["pid"] for v in seen.values()}) == world  # one proc per rank
    for (host, local), env in seen.items():
        assert env == {"pid": env["pid"], **master, "RANK": str(host * procs_per_host + local),
                       "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(procs_per_host)}
    results = [v for _, v in (await probes.all_reduce.call()).items()]
    assert sorted(r["rank"] for r in results) == list(range(world))
    assert all(r["world"] == world and r["sum"] == sum(range(world)) for r in results)


async def test_one_host_two_procs():
    async with start_runtime(gpus_per_host=2) as rm:
        await check_replica(rm, hosts=1, procs_per_host=2)


async def test_two_hosts_one_proc_each():
    async with start_runtime("processes", hosts=2, gpus_per_host=1) as rm:
        await check_replica(rm, hosts=2, procs_per_host=1)


async def test_one_proc_replica_is_rank_0_of_1():
    async with start_runtime(gpus_per_host=2) as rm:
        await check_replica(rm, hosts=1, procs_per_host=1)


async def test_shape_must_match_the_mesh():
    async with start_runtime(gpus_per_host=2) as rm:
        alloc = await rm.allocate(ResourceRequest("dist", 1, 2), owner="x")
        with pytest.raises(ValueError, match="1 host\\(s\\) x 2 procs"):
            await setup_distributed(alloc.procs, hosts=2, procs_per_host=1)


async def test_a_multi_proc_service_replica_gets_its_environment():
    from services import ServiceConfig, spawn_service

    async with start_runtime(gpus_per_host=2):
        svc = await spawn_service(ServiceConfig(procs_per_host=2, with_gpus=True),
                                  AllReduceProbe, name="dp")
        seen = [v for _, v in (await svc.replicas[0].actors.seen.call()).items()]
        assert sorted(s["RANK"] for s in seen) == ["0", "1"]
        assert {s["WORLD_SIZE"] for s in seen} == {"2"}
        assert await svc.all_reduce.route() == {"rank": 0, "world": 2, "sum": 1}
