"""GPU-aware first-fit packing of resource groups onto hosts.

A resource group holds whole GPUs on a contiguous run of hosts, the same number on each.
First fit by host: the lowest-numbered hosts with enough free GPUs, the lowest free GPUs on
each. A GPU is never given to two groups. A request that does not fit fails before anything
is spawned, with an error listing what is free.
"""

from __future__ import annotations

from dataclasses import dataclass

from colocate.checks import check_bool, check_int, check_name


class ResourceError(RuntimeError):
    """A request that cannot be served: it does not fit, or it names an unknown group."""


class ResourceValueError(ResourceError, ValueError):
    """A request or an inventory with a field of the wrong type or out of range (named in
    the message); a ValueError too, as a bad argument."""


@dataclass(frozen=True)
class ResourceRequest:
    """Hosts and procs (one per GPU when `with_gpus`) for a resource group."""

    resource_group: str
    hosts: int = 1
    procs_per_host: int = 1
    with_gpus: bool = True

    def __post_init__(self) -> None:
        for problem in (check_name("resource_group", self.resource_group),
                        check_int("hosts", self.hosts, 1),
                        check_int("procs_per_host", self.procs_per_host, 1),
                        check_bool("with_gpus", self.with_gpus)):
            if problem:
                raise ResourceValueError(f"ResourceRequest.{problem}")


@dataclass(frozen=True)
class Placement:
    """Where a group landed: its hosts and, per host, its GPU indices (empty without GPUs)."""

    resource_group: str
    hosts: tuple[int, ...]
    gpus: tuple[tuple[int, ...], ...]
    procs_per_host: int
    with_gpus: bool


class Inventory:
    """Which GPU of which host belongs to which group."""

    def __init__(self, num_hosts: int, gpus_per_host: int) -> None:
        for problem in (check_int("num_hosts", num_hosts, 1),
                        check_int("gpus_per_host", gpus_per_host, 0)):
            if problem:
                raise ResourceValueError(f"Inventory: {problem}")
        self.num_hosts = num_hosts
        self.gpus_per_host = gpus_per_host
        self.owner: dict[tuple[int, int], str] = {}
        self.placements: dict[str, Placement] = {}

    def free(self) -> dict[int, list[int]]:
        """Free GPU indices per host."""
        return {h: [g for g in range(self.gpus_per_host) if (h, g) not in self.owner]
                for h in range(self.num_hosts)}

    def describe_free(self) -> str:
        return ", ".join(f"host {h}: {len(gpus)} free {gpus}" for h, gpus in self.free().items())

    def place(self, request: ResourceRequest) -> Placement:
        """Give `request`'s group its GPUs, first fit by host; ResourceError if it can't."""
        group = request.resource_group
        if group in self.placements:
            raise ResourceError(f"resource group {group!r} is already placed")
        if request.hosts > self.num_hosts:
            raise ResourceError(f"{group!r} asks for {request.hosts} hosts; there are "
                                f"{self.num_hosts}")
        if not request.with_gpus:
            placement = Placement(group, tuple(range(request.hosts)), ((),) * request.hosts,
                                  request.procs_per_host, False)
            self.placements[group] = placement
            return placement
        if request.procs_per_host > self.gpus_per_host:
            raise ResourceError(f"{group!r} asks for {request.procs_per_host} GPUs per host; a "
                                f"host has {self.gpus_per_host}")
        free = self.free()
        for first in range(self.num_hosts - request.hosts + 1):
            hosts = range(first, first + request.hosts)
            if all(len(free[h]) >= request.procs_per_host for h in hosts):
                gpus = tuple(tuple(free[h][:request.procs_per_host]) for h in hosts)
                for h, host_gpus in zip(hosts, gpus, strict=True):
                    self.owner.update({(h, g): group for g in host_gpus})
                placement = Placement(group, tuple(hosts), gpus, request.procs_per_host, True)
                self.placements[group] = placement
                return placement
        raise ResourceError(
            f"{group!r} needs {request.hosts} contiguous host(s) with {request.procs_per_host} "
            f"free GPUs each; free now: {self.describe_free()}. Release a group, or ask for "
            "fewer GPUs per host.")

    def release(self, group: str) -> None:
        """Give the group's GPUs back."""
        if self.placements.pop(group, None) is None:
            raise ResourceError(f"resource group {group!r} is not placed; placed: "
                                f"{sorted(self.placements)}")
        self.owner = {slot: g for slot, g in self.owner.items() if g != group}
