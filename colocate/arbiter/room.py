"""Making room on a slot for a wake: the slot's free memory, what the wake needs, which
awake stages could sleep for it, and the policy's choice as plan steps.

Free memory is measured: on a GPU slot by NVML (the device's capacity, or
`ArbiterConfig.slot_capacity_bytes` when that is lower, less what the device holds now);
on a CPU slot, which has no capacity of its own, against the declared
`slot_capacity_bytes`, less what the slot's tenants hold in their tags now (the memory
layer's own count, which a pause really returns to the OS). A wake needs the bytes of the
stages it brings back, the tenant's working memory (`TenantInfo.working_bytes`), and what
the arbiter learned it took beyond that (`Slot.extra_need`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from colocate import telemetry
from colocate.arbiter.config import ArbiterConfig
from colocate.arbiter.errors import ArbiterError
from colocate.arbiter.plan import SLEEP, Step
from colocate.arbiter.policy import Policy, Resident
from colocate.arbiter.slot import Slot


def held_bytes(slot: Slot) -> int:
    """What the slot's live tenants hold in their tags now, by the stages awake."""
    held = 0
    for name, info in slot.infos.items():
        if name in slot.lost:
            continue
        if name in slot.unknown:
            held += info.resident_bytes
        else:
            held += sum(info.size(s) for s in slot.awake.get(name, ()))
    return held


def free_bytes(slot: Slot, config: ArbiterConfig) -> int:
    """The slot's free memory (see module)."""
    live = [i for n, i in slot.infos.items() if n not in slot.lost]
    if not live:
        raise ArbiterError(f"slot {slot.index} has no live tenant to measure from")
    cap = config.slot_capacity_bytes
    if live[0].device == "cpu":
        if cap is None:
            raise ArbiterError(f"slot {slot.index} has no known capacity: on CPU slots the "
                               "budget policy needs ArbiterConfig.slot_capacity_bytes")
        return cap - held_bytes(slot)
    reading = telemetry.read_gpu_uuid(live[0].device)
    capacity = reading.total_bytes if cap is None else min(cap, reading.total_bytes or cap)
    return capacity - reading.used_bytes


def used_bytes(slot: Slot, holder: str) -> int:
    """What the slot uses now that `holder` holds it: on a CPU slot its tenants' tags and
    the holder's working memory; on a GPU slot the device's reading."""
    device = slot.infos[holder].device
    if device == "cpu":
        return held_bytes(slot) + needed_bytes(slot, holder, (), working=True)
    return telemetry.read_gpu_uuid(device).used_bytes


def growth_bound(slot: Slot) -> int:
    """How much the slot's live tenants may hold beyond what they last said: their calls
    grow their tags only within their declared working memory (past it, a CPU slot's
    capacity refuses them; a GPU's free memory is measured, not counted)."""
    return sum(i.working_bytes + slot.extra_need.get(n, 0) for n, i in slot.infos.items()
               if n not in slot.lost)


def roomy(slot: Slot, config: ArbiterConfig, policy: Policy) -> bool:
    """Whether the slot has nothing to decide: under a policy that measures, every live
    tenant is wholly awake (none unknown) and the free memory holds every declared working
    memory at once (`growth_bound`), so no wake has anything to do and weights may be copied
    in place without a switch (`Handoffs.handoffs`)."""
    live = [n for n in slot.infos if n not in slot.lost]
    if not policy.measures or not live or slot.unknown or not all(
            set(slot.awake.get(n, ())) >= set(slot.infos[n].stages) for n in live):
        return False
    try:
        free = free_bytes(slot, config)
    except ArbiterError:  # no capacity known: a switch's own call says so
        return False
    return policy.has_room(growth_bound(slot), free)


def needed_bytes(slot: Slot, name: str, stages: Sequence[str], working: bool) -> int:
    """What waking `stages` of `name` takes: their bytes, and with `working` the tenant's
    working memory and what it was seen to need beyond it."""
    info = slot.infos[name]
    extra = info.working_bytes + slot.extra_need.get(name, 0) if working else 0
    return sum(info.size(s) for s in stages) + extra


def residents(slot: Slot, waking: str, wanted: Collection[str],
              protect: Collection[tuple[str, str]] = ()) -> list[Resident]:
    """The awake stages that may sleep for `waking` (which wants `wanted` awake): others',
    least recently woken tenant first, then `waking`'s own it does not want; each tenant's
    stages in reverse wake order. `protect` names (tenant, stage) pairs that stay."""
    order = [n for n in slot.awake_tenants() if n != waking]
    if slot.awake.get(waking):
        order.append(waking)
    found = []
    for name in order:
        info = slot.infos[name]
        for stage in reversed(slot.awake[name]):
            if (name, stage) in protect or (name == waking and stage in wanted):
                continue
            found.append(Resident(name, stage, info.size(stage), stage in info.kept
                                  or name in slot.unknown))
    return found


def sleep_steps(slot: Slot, chosen: Sequence[Resident]) -> list[Step]:
    """The chosen stages as verified sleeps, one step per tenant, in the order chosen (a
    tenant's every awake stage: its whole sleep)."""
    by_tenant: dict[str, list[str]] = {}
    for r in chosen:
        by_tenant.setdefault(r.tenant, []).append(r.stage)
    steps = []
    for name, stages in by_tenant.items():
        awake = slot.awake.get(name, ())
        whole = name in slot.unknown or set(awake) <= set(stages)
        steps.append(Step(SLEEP, name, None if whole else tuple(s for s in awake if s in stages),
                          verify=True, device=slot.infos[name].device))
    return steps
