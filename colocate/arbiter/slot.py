"""What the arbiter knows of one slot: `Slot` (its tenants, who is awake, who is lost, what
each was seen to need, its lock), `SlotTraffic` (what its switches moved), and `holding`,
a request's hold on the locks of its slots."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from colocate.arbiter.errors import ArbiterTimeoutError
from colocate.arbiter.tenant import TenantHandle, TenantInfo
from colocate.memory.traffic import Traffic


@dataclass(frozen=True)
class SlotTraffic:
    """What one slot's switches did so far: the bytes moved (`moved.copied_out`, `copied_in`,
    `discarded`), how often each tenant's stage slept ((tenant, stage) -> count), and the
    most memory the slot held right after a switch (with the awake tenant's working memory
    on CPU slots; the device's reading on GPU slots; 0 when the policy measures nothing),
    and the most host memory its tenants' backups held at once (a plan's sleeps copy out
    before its wakes copy back: at most what was out before it and all it copied out)."""

    moved: Traffic = Traffic()
    slept: dict[tuple[str, str], int] = field(default_factory=dict)
    peak_bytes: int = 0
    backup_peak_bytes: int = 0


@dataclass
class Slot:
    """One slot's tenants and their awake stages, as the arbiter last knew them."""

    index: int
    tenants: dict[str, TenantHandle] = field(default_factory=dict)
    infos: dict[str, TenantInfo] = field(default_factory=dict)
    awake: dict[str, tuple[str, ...]] = field(default_factory=dict)
    woken_order: list[str] = field(default_factory=list)  # least recently woken first
    unknown: set[str] = field(default_factory=set)  # state lost after a failure
    lost: dict[str, str] = field(default_factory=dict)  # tenant -> why: its proc died
    extra_need: dict[str, int] = field(default_factory=dict)  # tenant -> bytes beyond declared
    holder: str | None = None  # the tenant whose working memory a budget keeps free
    traffic: SlotTraffic = field(default_factory=SlotTraffic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def awake_tenants(self) -> list[str]:
        """The tenants with an awake stage, least recently woken first."""
        return [name for name in self.woken_order if self.awake.get(name)]

    def mark(self, name: str, stages: Iterable[str]) -> None:
        """Record `name`'s awake stages (and that it was woken last)."""
        stages = tuple(stages)
        self.awake[name] = stages
        if name in self.woken_order:
            self.woken_order.remove(name)
        self.woken_order.append(name)

    def learned(self, name: str, info: TenantInfo) -> None:
        """Record what tenant `name` said of itself: its state is known again."""
        self.infos[name] = info
        self.unknown.discard(name)
        self.mark(name, info.awake_stages)

    def who(self) -> str:
        """Who is awake, asleep, unknown or lost on this slot, in words."""
        parts = []
        for name in self.tenants:
            if name in self.lost:
                parts.append(f"{name} lost ({self.lost[name]})")
            elif name in self.unknown:
                parts.append(f"{name} unknown (treated as awake)")
            elif self.awake.get(name):
                parts.append(f"{name} awake ({', '.join(self.awake[name])})")
            else:
                parts.append(f"{name} asleep")
        return f"slot {self.index}: " + (", ".join(parts) or "no tenants")

    def forget(self, name: str) -> None:
        """Drop every trace of tenant `name`."""
        for table in (self.tenants, self.infos, self.awake, self.lost, self.extra_need):
            table.pop(name, None)
        if self.holder == name:
            self.holder = None
        self.unknown.discard(name)
        if name in self.woken_order:
            self.woken_order.remove(name)


@asynccontextmanager
async def holding(slots: list[Slot], timeout_s: float) -> AsyncIterator[None]:
    """Hold the locks of `slots` (given in slot order: no deadlock between requests), so
    that requests are served in arrival order per slot; raises `ArbiterTimeoutError`,
    naming who is where, when they are not all free within `timeout_s`."""
    held: list[Slot] = []
    try:
        async with asyncio.timeout(timeout_s):
            for slot in slots:
                await slot.lock.acquire()
                held.append(slot)
    except TimeoutError:
        for slot in held:
            slot.lock.release()
        raise ArbiterTimeoutError(
            f"waited {timeout_s} s for slot(s) {[s.index for s in slots]}; busy with earlier "
            "requests. " + "; ".join(s.who() for s in slots)
        ) from None
    try:
        yield
    finally:
        for slot in held:
            slot.lock.release()
