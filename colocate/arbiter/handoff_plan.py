"""The arbiter's side of a handoff: weights passed from one tenant to another on a slot
they share, as one plan, and how its failure is told (the client's side, which asks the
arbiters or copies in place: `colocate.resources.handoff_client`).

The one moment two tenants of a slot are partly awake. The plan, carried out in the
slot's proc: every other awake tenant sleeps, then the target, then the source's stages
beyond `keep` (each verified released); the target wakes `first`, copies the source's
weights (`receive`), the source sleeps (verified) and the target wakes its other stages.
Peak memory: the source's kept stages + the target's first stages, never both tenants
whole. On failure the request's undo log puts the slot back as it was: the source awake,
the target asleep.
"""

from __future__ import annotations

from collections.abc import Sequence

from colocate.arbiter.errors import ArbiterError
from colocate.arbiter.plan import RECEIVE, SLEEP, WAKE, Failure, Step
from colocate.arbiter.slot import Slot


def handoff_steps(slot: Slot, source: str, target: str, keep: Sequence[str],
                  first: Sequence[str]) -> list[Step]:
    """The handoff's steps on `slot`, in order (see module)."""
    source_stages = slot.awake.get(source, ())
    if not set(keep) <= set(source_stages) or slot.unknown or target in slot.lost:
        raise ArbiterError(f"handoff {source} -> {target} needs {source} awake with "
                           f"{list(keep)} on slot {slot.index}: {slot.who()}")

    def sleep(name: str, stages: Sequence[str] | None = None) -> list[Step]:
        awake = slot.awake.get(name, ())
        todo = [s for s in awake if stages is None or s in stages]
        return [Step(SLEEP, name, None if stages is None else tuple(todo), verify=True,
                     device=slot.infos[name].device)] if todo else []

    device = slot.infos[target].device
    rest = tuple(s for s in slot.infos[target].stages if s not in first)
    steps = [step for other in slot.awake_tenants() if other not in (source, target)
             for step in sleep(other)]
    steps += sleep(target)
    steps += sleep(source, [s for s in source_stages if s not in keep])
    steps += [Step(WAKE, target, tuple(first), device=device),
              Step(RECEIVE, target, source=source, device=device),
              Step(SLEEP, source, None, verify=True, device=slot.infos[source].device)]
    if rest:
        steps.append(Step(WAKE, target, rest, device=device))
    return steps


def handoff_error(slot: Slot, source: str, target: str, first: Sequence[str],
                  failure: Failure, step: Step, note: str) -> str:
    """The message of a handoff that stopped at `step`, after the rollback."""
    cause = f"{step.tenant} slept but {failure.cause}" if failure.kind == "release" \
        else failure.cause
    torn = (f"; {target}'s {list(first)} may hold part of {source}'s now: hand off again "
            f"before {target} serves") if step.op == RECEIVE else ""
    return (f"handoff {source} -> {target} failed on slot {slot.index} at {failure.label}: "
            f"{cause}; rolled back: {slot.who()}{torn}{note}")
