"""`spawn_service`: allocate each replica's procs in its resource group and spawn the actors."""

from __future__ import annotations

import itertools
from typing import Any, TypeVar

from colocate.resources.manager import ResourceManager, current
from colocate.resources.packing import ResourceRequest
from services.config import ServiceConfig, ServiceConfigError
from services.restart import group_restarts
from services.service import Service

_names = itertools.count()
A = TypeVar("A")


def _group_for(replica: ResourceRequest, replicas: int, gpus_per_host: int) -> ResourceRequest:
    """A new group's shape: `replicas` replicas side by side on each host (as many as its
    GPUs allow; without GPUs, all of them), then more hosts."""
    fit = gpus_per_host // replica.procs_per_host if replica.with_gpus else replicas
    per_host = max(1, min(replicas, fit))
    host_rows = -(-replicas // per_host)
    return ResourceRequest(replica.resource_group, replica.hosts * host_rows,
                           replica.procs_per_host * per_host, replica.with_gpus)


async def spawn_service(config: ServiceConfig, actor_class: type[A], *args: Any,
                        name: str | None = None, rm: ResourceManager | None = None,
                        **kwargs: Any) -> Service[A]:
    """Start `config.num_replicas` replicas of `actor_class(*args, **kwargs)`.

    Replicas of services in one resource group share procs (one per GPU), so a
    `TenantActor` service time-shares them with the group's other services. With
    `config.restart="group"` they come back together after a failure (`services.restart`).
    """
    rm = rm or current()
    name = name or f"{actor_class.__name__.lower()}{next(_names)}"
    config.check_fits(rm.num_hosts, rm.gpus_per_host)
    group = config.resource_group or name
    request = ResourceRequest(group, config.hosts_per_replica, config.procs, config.with_gpus)
    if rm.has_group(group) and not config.with_gpus and rm.group(group).placement.with_gpus:
        raise ServiceConfigError(
            f"ServiceConfig: with_gpus=False, but resource group {group!r} has GPUs: its "
            f"procs are slot procs, which {name!r} would share (and a proc it loses would be "
            "a slot's); give it a resource group of its own")
    if not rm.has_group(group):  # room for max_replicas, so scaling up finds procs
        await rm.reserve(_group_for(request, config.max, rm.gpus_per_host))
    service = Service(name, config, actor_class, rm, request, group_restarts(group, rm),
                      args, kwargs)
    await service.start()
    return service
