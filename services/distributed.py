"""A torch.distributed environment for the procs of one multi-proc replica.

    alloc = await rm.allocate(ResourceRequest("rl", hosts=2, procs_per_host=4), owner="t")
    master = await setup_distributed(alloc)    # before the replica's actors are spawned
    trainer = await rm.spawn("trainer", Trainer, alloc)

`setup_distributed` does for a slice of procs what torchrun (and Monarch's SPMD `serve()`)
does for its workers: it spawns a short-lived `DistEnv` actor on every proc, asks rank 0
for its address and a free TCP port, and sets in each proc's `os.environ`

    MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    GROUP_RANK, GROUP_WORLD_SIZE

with ranks in mesh order: RANK = host * procs_per_host + local rank (the "gpus" index). Then
it stops the `DistEnv` actors. Every actor spawned on those procs afterwards runs in the same
process, so it sees the variables and can join the group with the env:// rendezvous:

    class Trainer(Actor):
        def __init__(self):
            torch.distributed.init_process_group("nccl")   # or "gloo" on CPU procs
            self.rank = torch.distributed.get_rank()

(or in an endpoint that every rank calls: `init_process_group` blocks until all
WORLD_SIZE ranks have joined). The GPU procs of a resource group see only their own GPU
(CUDA_VISIBLE_DEVICES), so the device is always "cuda:0", whatever LOCAL_RANK is.

MASTER_ADDR is 127.0.0.1 when every proc runs on the same machine in the same network
namespace as rank 0 (one host, or the "processes" scheduler's hosts); otherwise it is
rank 0's address as other machines reach it: its FQDN resolved to a non-loopback IP, else
the IP of its default route, else its FQDN. Pass `master_addr=` to choose it yourself.

The variables belong to the proc, not to an actor: procs of a resource group are shared by
the services placed on it, and the last `setup_distributed` on a proc wins. Call it right
before spawning the replica that uses it, and have that replica read the variables (or
init its process group) in its `__init__`. The port is found free when `setup_distributed`
runs and only taken when rank 0 inits its process group; pass `master_port=` to pin it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import os
import socket
from typing import Any

from monarch.actor import Actor, endpoint

from colocate.resources.groups import Allocation
from colocate.resources.procs import rank_of

_names = itertools.count()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _machine() -> str:
    """Who can reach this proc on 127.0.0.1: the kernel (boot id) and network namespace;
    the hostname where /proc does not tell."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return f"host:{socket.gethostname()}"


def _reachable_elsewhere(ip: str) -> bool:
    """Whether another machine could dial `ip`: not loopback, link-local or unspecified."""
    address = ipaddress.ip_address(ip.split("%")[0])
    return not (address.is_loopback or address.is_link_local or address.is_unspecified)


def _reachable_address() -> str:
    """This machine's address as other machines reach it (see the module docstring)."""
    fqdn = socket.getfqdn()
    try:
        found = socket.getaddrinfo(fqdn, None, type=socket.SOCK_STREAM)
    except OSError:
        found = []
    for family in (socket.AF_INET, socket.AF_INET6):
        for fam, *_, sockaddr in found:
            if fam == family and _reachable_elsewhere(str(sockaddr[0])):
                return str(sockaddr[0])
    try:  # the interface of the default route; a UDP connect sends nothing
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            ip = s.getsockname()[0]
        if _reachable_elsewhere(ip):
            return ip
    except OSError:
        pass
    return fqdn


class DistEnv(Actor):
    """Runs on each proc of a replica: tells where the proc is, and sets its environment."""

    @endpoint
    def where(self, master: bool = False) -> dict[str, Any]:
        """The proc's machine and hostname; on the master (rank 0) also its reachable
        address and a TCP port free on all its interfaces."""
        info: dict[str, Any] = {"machine": _machine(), "hostname": socket.gethostname(),
                                "pid": os.getpid()}
        if master:
            info.update(address=_reachable_address(), port=_free_port())
        return info

    @endpoint
    def set_env(self, env: dict[str, str]) -> dict[str, str]:
        """Set `env` in this proc's `os.environ`; returns it as the proc now sees it."""
        os.environ.update(env)
        return {key: os.environ[key] for key in env}


def _shape(procs: Any) -> tuple[int, int]:
    """(hosts, procs per host) of a proc mesh with dims (hosts, gpus) or only gpus."""
    sizes = dict(zip(procs.extent.labels, procs.extent.sizes, strict=True))
    if set(sizes) - {"hosts", "gpus"} or "gpus" not in sizes:
        raise ValueError(f"setup_distributed needs a proc mesh with dims (hosts, gpus) or "
                         f"(gpus); got {sizes}")
    return sizes.get("hosts", 1), sizes["gpus"]


async def setup_distributed(procs: Allocation | Any, hosts: int | None = None,
                            procs_per_host: int | None = None, *,
                            master_addr: str | None = None,
                            master_port: int | None = None) -> dict[str, str]:
    """Give every proc of `procs` (an `Allocation`, or a proc mesh with dims (hosts, gpus)
    or only gpus) a torch.distributed environment; see the module docstring.

    `hosts` and `procs_per_host` default to the allocation's (or the mesh's) shape and, when
    given, must match it. Returns what all ranks share: MASTER_ADDR, MASTER_PORT and
    WORLD_SIZE.
    """
    if isinstance(procs, Allocation):
        hosts = procs.hosts if hosts is None else hosts
        procs_per_host = procs.procs_per_host if procs_per_host is None else procs_per_host
        procs = procs.procs
    mesh_hosts, mesh_per_host = _shape(procs)
    hosts = mesh_hosts if hosts is None else hosts
    procs_per_host = mesh_per_host if procs_per_host is None else procs_per_host
    if (hosts, procs_per_host) != (mesh_hosts, mesh_per_host):
        raise ValueError(f"hosts={hosts}, procs_per_host={procs_per_host}, but the proc mesh "
                         f"is {mesh_hosts} host(s) x {mesh_per_host} procs")
    world = hosts * procs_per_host

    def proc(actors: Any, rank: int) -> Any:
        return rank_of(actors, rank, procs_per_host)

    actors = procs.spawn(f"dist_env{next(_names)}", DistEnv)
    try:
        master = await proc(actors, 0).where.call_one(master=True)
        if master_addr is None:
            found = await actors.where.call()
            same = all(info["machine"] == master["machine"] for _, info in found.items())
            master_addr = "127.0.0.1" if same else master["address"]
        shared = {"MASTER_ADDR": master_addr,
                  "MASTER_PORT": str(master_port or master["port"]),
                  "WORLD_SIZE": str(world)}

        def env(rank: int) -> dict[str, str]:
            host, local = divmod(rank, procs_per_host)
            return {**shared, "RANK": str(rank), "LOCAL_RANK": str(local),
                    "LOCAL_WORLD_SIZE": str(procs_per_host), "GROUP_RANK": str(host),
                    "GROUP_WORLD_SIZE": str(hosts)}

        await asyncio.gather(*(proc(actors, rank).set_env.call_one(env(rank))
                               for rank in range(world)))
    finally:
        await actors.stop()
    return shared
