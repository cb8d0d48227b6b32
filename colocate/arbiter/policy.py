"""Who must sleep next so that a tenant can wake: the exclusive and the budget policies.

The arbiter asks `next_victim` again after each verified sleep, with the free memory
measured anew, until it answers None.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Exclusive:
    """One awake tenant per slot (the default)."""

    def next_victim(self, waking: str, awake: Sequence[str], needed_bytes: int,
                    free_bytes: int | None) -> str | None:
        others = [name for name in awake if name != waking]
        return others[0] if others else None


@dataclass(frozen=True)
class Budget:
    """Several awake tenants while the measured free memory allows.

    The waking tenant needs `needed_bytes` plus `headroom_bytes` free; until then the least
    recently woken other tenant sleeps (`awake` comes in that order).
    """

    headroom_bytes: int = 0

    def next_victim(self, waking: str, awake: Sequence[str], needed_bytes: int,
                    free_bytes: int | None) -> str | None:
        if free_bytes is None:
            raise ValueError("the budget policy needs the slot's capacity: on CPU slots set "
                             "ArbiterConfig.slot_capacity_bytes")
        if free_bytes >= needed_bytes + self.headroom_bytes:
            return None
        others = [name for name in awake if name != waking]
        return others[0] if others else None


POLICIES = {"exclusive": Exclusive, "budget": Budget}
