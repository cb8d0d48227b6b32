"""One undo log per request: what every tenant a request touched held before it, per slot,
and the plan of `restore` steps that brings a slot back to that.

A request (a wake, a sleep, a registration, a handoff) remembers each tenant the first
time one of its plans touches it. When a step fails, the arbiter rolls the slot back with
one restore plan per proc (sent to the same actor as the failed plan, so it runs after
it even when that one hangs): the tenants that were asleep before are put to sleep first,
then the others woken to their stages before. A restore step reads the tenant's own state
first, so it is right whether the failed plan stopped early, late, or was still running
when the arbiter stopped waiting. Lost tenants (dead procs) hold nothing and are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from colocate.arbiter.plan import RESTORE, Step
from colocate.arbiter.slot import Slot


@dataclass
class UndoLog:
    """The before-state of one request, per slot; and which actor ran its plans per proc."""

    before: dict[int, dict[str, tuple[str, ...]]] = field(default_factory=dict)
    runners: dict[tuple[int, int], str] = field(default_factory=dict)  # (slot, pid) -> tenant

    def remember(self, slot: Slot, names: Iterable[str]) -> None:
        """Note `names`' awake stages on `slot` unless already noted by this request. A
        tenant whose state is unknown is noted asleep (it is not woken by a rollback)."""
        noted = self.before.setdefault(slot.index, {})
        for name in names:
            if name not in noted:
                noted[name] = () if name in slot.unknown else slot.awake.get(name, ())

    def restore_steps(self, slot: Slot) -> list[Step]:
        """The rollback of `slot`: those asleep before first (they only sleep), then the rest."""
        noted = [(name, stages) for name, stages in self.before.get(slot.index, {}).items()
                 if name in slot.tenants and name not in slot.lost]
        noted.sort(key=lambda item: bool(item[1]))
        return [Step(RESTORE, name, stages, device=slot.infos[name].device)
                for name, stages in noted]
