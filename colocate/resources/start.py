"""`colocate.init`: start the hosts of a runtime and their arbiters, and make it the
current one (`manager.current()`)."""

from __future__ import annotations

import asyncio
from typing import Any

import monarch.actor

from colocate.arbiter.config import ArbiterConfig
from colocate.checks import check_int
from colocate.resources.gpus import gpus_per_host as detect_gpus
from colocate.resources.hosts import start_hosts
from colocate.resources.manager import ResourceManager, make_current
from colocate.resources.packing import ResourceError, ResourceValueError


async def init(scheduler: Any = "local", hosts: int = 1, gpus_per_host: int | None = None,
               arbiter: ArbiterConfig | None = None, **options: Any) -> ResourceManager:
    """Start the hosts and their arbiters and return the ResourceManager.

    `gpus_per_host` defaults to the GPUs NVML sees; on a machine without GPUs give it to get
    that many virtual slots (CPU procs).
    """
    found = detect_gpus()
    if gpus_per_host is None:
        if found == 0:
            raise ResourceError("no GPU found on this host: pass gpus_per_host=N to run with N "
                                "virtual GPU slots (CPU procs)")
        gpus_per_host = found
    problem = (check_int("gpus_per_host", gpus_per_host, 1)
               or check_int("hosts", hosts, 1, optional=True))
    if problem:  # checked before any host starts, so a bad value leaves nothing running
        raise ResourceValueError(f"init: {problem}")
    if found and gpus_per_host > found:
        raise ResourceError(f"gpus_per_host={gpus_per_host}, but this host has {found} GPUs")
    if arbiter is not None and not isinstance(arbiter, ArbiterConfig):
        raise TypeError(f"init(arbiter=...) takes an ArbiterConfig, not {arbiter!r}")
    job = await asyncio.to_thread(start_hosts, scheduler, hosts, **options)
    try:
        rm = ResourceManager(job, gpus_per_host, virtual=found == 0,
                             arbiter_config=arbiter or ArbiterConfig())
        monarch.actor.unhandled_fault_hook = rm.faults.on_fault
        await rm.start()
    except BaseException:
        job.stop()
        raise
    make_current(rm)
    return rm
