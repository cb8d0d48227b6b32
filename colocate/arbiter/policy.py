"""Who must sleep next so that a tenant can wake: the exclusive and the budget policies.

The arbiter asks `next_victim` again after each verified sleep, with the free memory
measured anew, until it answers None.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def _least_recently_woken(waking: str, awake: Sequence[str]) -> str | None:
    return next((name for name in awake if name != waking), None)


@dataclass(frozen=True)
class Exclusive:
    """One awake tenant per slot (the default)."""

    def next_victim(self, waking: str, awake: Sequence[str], needed_bytes: int,
                    free_bytes: int | None) -> str | None:
        return _least_recently_woken(waking, awake)


@dataclass(frozen=True)
class Budget:
    """Several awake tenants while the measured free memory allows.

    The waking tenant needs `needed_bytes` plus `headroom_bytes` free; until then the least
    recently woken other tenant sleeps (`awake` comes in that order).
    """

    headroom_bytes: int = 0

    def next_victim(self, waking: str, awake: Sequence[str], needed_bytes: int,
                    free_bytes: int | None) -> str | None:
        # free_bytes is always measured here: the arbiter raises first when a slot has no
        # known capacity (ArbiterConfig.slot_capacity_bytes on CPU slots)
        if free_bytes is not None and free_bytes >= needed_bytes + self.headroom_bytes:
            return None
        return _least_recently_woken(waking, awake)


POLICIES = {"exclusive": Exclusive, "budget": Budget}
