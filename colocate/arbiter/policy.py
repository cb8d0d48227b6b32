"""The arbiter's policies: each answers the questions `core.SlotArbiter` asks of it.

- `measures`: does memory matter? Only then does the arbiter learn each stage's size and
  measure the slot's free memory; otherwise it measures nothing and passes `free_bytes=None`.
- `may_share(awake)`: may these tenants be awake together on one slot? Asked when a
  tenant registers awake beside others, and checked after every switch.
- `has_room(needed_bytes, free_bytes)`: can a tenant that needs `needed_bytes` more wake
  now? Asked before any sleep, and again after the policy's sleeps.
- `to_sleep(waking, resident, needed_bytes, free_bytes)`: which awake stages sleep so that
  `waking` can wake, chosen from `resident`: every other tenant's awake stage (least
  recently woken tenant first, each tenant's stages in reverse wake order, so caches and
  gradients before optimizer state and weights) and `waking`'s own awake stages that the
  wake does not need. Asked again after each round of verified sleeps, with the free memory
  measured anew, until it has room or chooses nothing.

`ArbiterConfig(policy=...)` takes a name in `POLICIES` (built with the class's
`from_config(config)`) or any object with these answers (`Policy`). A new policy is a
new class; the arbiter's core does not change.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable


@dataclass(frozen=True)
class Resident:
    """One awake stage of a tenant on a slot, as a candidate to sleep."""

    tenant: str
    stage: str
    nbytes: int  # what its sleep frees
    copied: bool  # its sleep copies it to host memory (and its wake back); else it is dropped


@runtime_checkable
class Policy(Protocol):
    """What the arbiter asks a policy (see the module's docstring)."""

    measures: bool

    def may_share(self, awake: Sequence[str]) -> bool: ...

    def has_room(self, needed_bytes: int, free_bytes: int | None) -> bool: ...

    def to_sleep(self, waking: str, resident: Sequence[Resident], needed_bytes: int,
                 free_bytes: int | None) -> list[Resident]: ...


@dataclass(frozen=True)
class Exclusive:
    """One awake tenant per slot: every other tenant sleeps whole first."""

    measures: ClassVar[bool] = False

    @classmethod
    def from_config(cls, config: Any) -> Exclusive:
        return cls()

    def may_share(self, awake: Sequence[str]) -> bool:
        return len(awake) <= 1

    def has_room(self, needed_bytes: int, free_bytes: int | None) -> bool:
        return True  # the room is made by the others' sleeps

    def to_sleep(self, waking: str, resident: Sequence[Resident], needed_bytes: int,
                 free_bytes: int | None) -> list[Resident]:
        return [r for r in resident if r.tenant != waking]


# at most this many stages are weighed together for the fewest bytes to copy (2^n subsets);
# a slot holds a few tenants of a few stages each, so a greedy choice above it is a fallback
EXACT_CANDIDATES = 12


@dataclass(frozen=True)
class Budget:
    """Tenants and stages stay awake while the measured free memory allows.

    The waking tenant needs `needed_bytes` (the stages it wakes and its working memory)
    plus `headroom_bytes` free. Until then stages sleep, cheapest first: those dropped
    without a copy (gradients, caches, weights that the next sync overwrites), in the
    order given; then, of those that must be copied to host memory, the set that covers
    the rest with the fewest bytes (ties: fewer stages, then the order given: optimizer
    state before weights, least recently woken tenant first). When even every stage given
    would not make room, none is chosen: the wake fails and nothing moved for it.
    """

    headroom_bytes: int = 0
    measures: ClassVar[bool] = True

    @classmethod
    def from_config(cls, config: Any) -> Budget:
        return cls(config.headroom_bytes)

    def may_share(self, awake: Sequence[str]) -> bool:
        return True

    def has_room(self, needed_bytes: int, free_bytes: int | None) -> bool:
        # free_bytes is always measured here: the arbiter raises first when a slot has no
        # known capacity (ArbiterConfig.slot_capacity_bytes on CPU slots)
        return free_bytes is not None and free_bytes >= needed_bytes + self.headroom_bytes

    def to_sleep(self, waking: str, resident: Sequence[Resident], needed_bytes: int,
                 free_bytes: int | None) -> list[Resident]:
        deficit = needed_bytes + self.headroom_bytes - (free_bytes or 0)
        if deficit > sum(r.nbytes for r in resident):
            return []  # it cannot fit: nothing moves for nothing
        chosen: list[Resident] = []
        for r in resident:
            if deficit <= 0:
                return chosen
            if not r.copied and r.nbytes > 0:
                chosen.append(r)
                deficit -= r.nbytes
        if deficit <= 0:
            return chosen
        copies = [r for r in resident if r.copied and r.nbytes > 0]
        return chosen + fewest_bytes(copies, deficit)


def fewest_bytes(candidates: Sequence[Resident], deficit: int) -> list[Resident]:
    """The candidates whose bytes cover `deficit` with the fewest bytes in all (ties: fewer
    of them, then earlier ones); the caller checked that all of them do."""
    if len(candidates) > EXACT_CANDIDATES:  # greedy: the largest first
        chosen, left = [], deficit
        for r in sorted(candidates, key=lambda r: -r.nbytes):
            if left <= 0:
                break
            chosen.append(r)
            left -= r.nbytes
        return [r for r in candidates if r in chosen]
    best: tuple[int, int, tuple[int, ...]] | None = None
    for size in range(1, len(candidates) + 1):
        for picked in itertools.combinations(range(len(candidates)), size):
            total = sum(candidates[i].nbytes for i in picked)
            key = (total, size, picked)
            if total >= deficit and (best is None or key < best):
                best = key
    assert best is not None, "the caller checks that all of them cover the deficit"
    return [candidates[i] for i in best[2]]


POLICIES: dict[str, Any] = {"exclusive": Exclusive, "budget": Budget}  # name -> class
