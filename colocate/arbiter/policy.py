"""The arbiter's policies: each answers the questions `core.SlotArbiter` asks of it.

- `measures`: does a tenant's size matter? Only then does the arbiter ask the waking
  tenant its size and measure the slot's free memory; otherwise it measures nothing and
  passes `free_bytes=None`.
- `may_share(awake)`: may these tenants be awake together on one slot? Asked when a
  tenant registers awake beside others, and checked after every switch.
- `has_room(needed_bytes, free_bytes)`: can a tenant that needs `needed_bytes` more wake
  now? Asked once the policy's sleeps are done.
- `next_victim(waking, awake, needed_bytes, free_bytes)`: who sleeps next so that
  `waking` can wake (None: nobody). Asked again after each verified sleep, with the free
  memory measured anew, until it answers None.

`ArbiterConfig(policy=...)` takes a name in `POLICIES` (built with the class's
`from_config(config)`) or any object with the four answers (`Policy`). A new policy is a
new class; the arbiter's core does not change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable


@runtime_checkable
class Policy(Protocol):
    """What the arbiter asks a policy (see the module's docstring)."""

    measures: bool

    def may_share(self, awake: Sequence[str]) -> bool: ...

    def has_room(self, needed_bytes: int, free_bytes: int | None) -> bool: ...

    def next_victim(self, waking: str, awake: Sequence[str], needed_bytes: int,
                    free_bytes: int | None) -> str | None: ...


def least_recently_woken(waking: str, awake: Sequence[str]) -> str | None:
    """The first of `awake` (least recently woken first) that is not `waking`."""
    return next((name for name in awake if name != waking), None)


@dataclass(frozen=True)
class Exclusive:
    """One awake tenant per slot (the default): every other tenant sleeps first."""

    measures: ClassVar[bool] = False

    @classmethod
    def from_config(cls, config: Any) -> Exclusive:
        return cls()

    def may_share(self, awake: Sequence[str]) -> bool:
        return len(awake) <= 1

    def has_room(self, needed_bytes: int, free_bytes: int | None) -> bool:
        return True  # the room is made by the others' sleeps

    def next_victim(self, waking: str, awake: Sequence[str], needed_bytes: int,
                    free_bytes: int | None) -> str | None:
        return least_recently_woken(waking, awake)


@dataclass(frozen=True)
class Budget:
    """Several awake tenants while the measured free memory allows.

    The waking tenant needs `needed_bytes` plus `headroom_bytes` free; until then the least
    recently woken other tenant sleeps (`awake` comes in that order).
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

    def next_victim(self, waking: str, awake: Sequence[str], needed_bytes: int,
                    free_bytes: int | None) -> str | None:
        if self.has_room(needed_bytes, free_bytes):
            return None
        return least_recently_woken(waking, awake)


POLICIES: dict[str, Any] = {"exclusive": Exclusive, "budget": Budget}  # name -> class
