"""`sync_weights(trainer, generator)`: the trainer's weights to every generator replica.

A generator replica in the same processes as a trainer replica (one resource group) gets
them by a staged handoff through the arbiters: its weights wake while the trainer keeps only
its weights, it copies them in place, the trainer sleeps, then its caches wake. So the
peak is the two weight sets, never trainer + generator + cache. A replica on other procs
of the same host loads them from shared memory, exported once by the trainer's rank 0 (its
other ranks take part in the gathers of a sharded trainer), with only the stages its load
endpoint needs woken for it (`colocate.needs`: a generator's weights, not its cache; one
respawned on new procs for the trainer's slots shares the slots, not the processes: the
trainer sleeps there once its export is written); a replica on another host reads them
from the trainer's rank 0 over Monarch RDMA buffers, woken likewise. From an FSDP trainer the
colocated handoffs must cover every trainer proc, since each bucket is gathered by all
its ranks at once (the RL loop's shape: one generator replica per trainer proc); a sync
that would leave some out (the left-out ranks would never join the gathers, and the
handoff would hang) is refused with `WeightSyncError` before anything is switched.
The handoffs run all at once, and so do the loads. A generator replica found dead on the
way is reported lost and left to its service, which respawns it; the others are synced
all the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from colocate.arbiter.actor import remote_errors
from colocate.arbiter.errors import ArbiterError, TenantLostError
from colocate.resources.manager import ResourceManager
from services.errors import ServiceUnavailableError, WeightSyncError
from services.replica import Replica, ReplicaState
from services.service import Service


@dataclass
class SyncReport:
    """Bytes copied per generator replica tenant, and how; the replicas found dead."""

    handoff: dict[str, int] = field(default_factory=dict)
    shared_memory: dict[str, int] = field(default_factory=dict)
    rdma: dict[str, int] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(self.handoff.values()) + sum(self.shared_memory.values()) + \
            sum(self.rdma.values())


def _healthy(service: Service) -> list[Replica]:
    replicas = [r for r in service.replicas if r.state is ReplicaState.HEALTHY]
    if not replicas:
        raise ServiceUnavailableError(f"service {service.name!r} has no healthy replica to "
                                      f"sync weights with: {service.failures()}")
    return replicas


# how a replica on other procs gets the weights: the trainer's rank 0 offers them (its
# endpoint), then the replica loads them (its endpoint)
WAYS = {"shared_memory": ("export_weights", "load_exported"),  # a replica on this host
        "rdma": ("offer_weights", "load_remote")}  # a replica on another host


def _way(replica: Replica, source_host: int) -> str:
    hosts = {h for h, _ in replica.allocation.slots}
    return "shared_memory" if hosts == {source_host} else "rdma"


async def _wake_and_load(rm: ResourceManager, replica: Replica, load: str,
                         stages: tuple[str, ...] | None, offered: Any) -> Any:
    """Wake the `stages` of `replica` that its `load` endpoint needs (None: every stage;
    where it shares the trainer's slots from other processes, the trainer sleeps there: its
    weights were exported already), then have it load them."""
    await rm.wake_for(replica.tenant, stages)
    return await getattr(replica.actors, load).call(offered)


async def _check_coverage(trainer: Service, source: Replica, generator: Service,
                          colocated: Sequence[Replica]) -> None:
    """Refuse handoffs that reach only some procs of a trainer whose weights need every
    rank (FSDP): the ranks left out would never join the gathers of the ranks handing off,
    which would wait until the arbiter's call timeout, holding both tenants mid-switch."""
    covered = {slot for r in colocated for slot in r.allocation.slots}
    left_out = [(rank, slot) for rank, slot in enumerate(source.allocation.slots)
                if slot not in covered]
    if not colocated or not left_out:
        return
    async with remote_errors():
        sharded = await source.call("weights_need_every_rank", (), {})
    if not sharded:
        return  # each rank holds the whole model: any of them can hand it off
    procs, shape = len(source.allocation.slots), source.allocation
    spanning = f"procs_per_host={shape.procs_per_host}" if shape.hosts == 1 else \
        f"hosts_per_replica={shape.hosts}, procs_per_host={shape.procs_per_host}"
    raise WeightSyncError(
        f"sync_weights({trainer.name!r} -> {generator.name!r}): trainer replica "
        f"{source.tenant} shards its weights over {procs} procs (FSDP; (host, slot)s "
        f"{list(source.allocation.slots)}), and each bucket is gathered by all its ranks at "
        f"once, but the generator replicas on its procs, "
        + ", ".join(f"{r.tenant} on {list(r.allocation.slots)}" for r in colocated)
        + ", leave out "
        + ", ".join(f"rank {rank} on {slot}" for rank, slot in left_out)
        + "; nothing was switched. Cover every trainer proc: give the generator one "
        f"replica per trainer proc (ServiceConfig(num_replicas={procs}) in the trainer's "
        f"resource group), or one replica over all of them "
        f"(ServiceConfig({spanning})), and sync them together (replicas=None); "
        "or train with parallel='ddp' (every rank holds the whole model).")


async def sync_weights(trainer: Service, generator: Service,
                       replicas: Sequence[Replica] | None = None) -> SyncReport:
    """Copy the weights of `trainer` (its first healthy replica holds the reference; DDP
    keeps every rank equal) into `replicas` of `generator` (default: every healthy one).
    Raises `WeightSyncError`, before any switch, when the handoffs would reach only some
    procs of an FSDP trainer."""
    rm = trainer.rm
    source = _healthy(trainer)[0]
    source_pids = set(source.allocation.pids)
    source_host = source.allocation.slots[0][0]
    report = SyncReport()
    targets = _healthy(generator) if replicas is None else list(replicas)
    # replicas in the trainer's own processes: staged handoffs, all at once (their slots
    # differ); one respawned on new procs for the trainer's slots is apart, as any other
    colocated = [r for r in targets if set(r.allocation.pids) <= source_pids]
    apart = [r for r in targets if not set(r.allocation.pids) <= source_pids]
    await _check_coverage(trainer, source, generator, colocated)
    if colocated:  # all at once; a failed one rolled its slots back
        report.handoff.update(await rm.handoffs(source.tenant, [r.tenant for r in colocated]))
    for way, (offer, load) in WAYS.items():
        readers = [r for r in apart if _way(r, source_host) == way]
        if not readers:
            continue
        async with remote_errors():  # every rank takes part (FSDP gathers); rank 0 answers
            offered = await source.call(offer, (), {})
        stages = generator.needs.get(load)  # what its load endpoint declares
        loads = await asyncio.gather(*(_wake_and_load(rm, r, load, stages, offered)
                                       for r in readers), return_exceptions=True)
        for replica, loaded in zip(readers, loads, strict=True):
            if not isinstance(loaded, BaseException):
                getattr(report, way)[replica.tenant] = sum(v for _, v in loaded.items())
            elif isinstance(loaded, TenantLostError):  # its service heard of it already
                report.lost.append(replica.tenant)
            elif isinstance(loaded, ArbiterError):
                raise loaded  # its wake failed, rolled back (the error says who is awake)
            elif generator.lose(replica, loaded):
                report.lost.append(replica.tenant)
            else:
                raise loaded.exception from None  # the load itself raised (an ActorError)
    return report
