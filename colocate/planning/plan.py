"""A run's plan for one step over all its slots, and a run's figures held against it.

`plan_run` forecasts each slot (forecast.py) and prices the steady step's switches with
this machine's rates (rates.py): the slots switch in parallel, so a step's switch time is
its slowest slot's. Host memory: the backups every slot holds at once (on CUDA, the pinned
buffers, which stay once made: every kept stage ever copied out) and what the caller says
the host holds besides (its own process). It fits when every slot's turns could be made
and the host peak is within the host's capacity, if one is given, and no CUDA backup would go
to disk (the memory layer's CUDA backend has none); `why` says which not.

`check(predicted, measured)` gives each figure's signed relative error, (predicted -
measured) / measured, against `TARGETS`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from colocate.arbiter.policy import Policy
from colocate.memory import HOST
from colocate.planning.forecast import (
    Moved,
    SlotForecast,
    Switch,
    Sync,
    TenantSpec,
    Turn,
    forecast_slot,
)
from colocate.planning.rates import Rates

# figure -> the most a plan may be off by (relative): bytes moved per step, switch + sync
# time per step, the peak slot memory, the peak host memory
TARGETS = {"bytes_moved": 0.01, "switch_time": 0.25, "peak_slot": 0.10, "peak_host": 0.15}


@dataclass
class Plan:
    """The forecast of every slot, priced (see module)."""

    slots: list[SlotForecast]
    step: list[Turn]
    rates: Rates
    policy: str
    host_capacity_bytes: int | None = None
    host_other_bytes: int = 0  # what the host holds besides the backups
    pinned: bool = False  # backups in pinned buffers kept across switches (CUDA)
    slots_per_host: int = 1  # slots that switch together under one host's arbiter
    notes: dict[str, Any] = field(default_factory=dict)  # the caller's (what it planned)

    def seconds(self, switch: Switch, turn: Turn) -> float:
        """One switch's predicted time."""
        way = switch.way
        if way == "arbiter":
            way = "sync" if isinstance(turn, Sync) else "wake"
        return self.rates.seconds(way, switch.copied_out - switch.to_disk,
                                  switch.copied_in - switch.from_disk, switch.discarded,
                                  switch.refilled, switch.in_slot_bytes, self.slots_per_host,
                                  switch.to_disk, switch.from_disk, switch.tensors,
                                  switch.disk_stages)

    def slot_seconds(self, slot: SlotForecast) -> dict[str, float]:
        """The steady step's switch and sync seconds on `slot`."""
        found = {"switch_s": 0.0, "sync_s": 0.0}
        for switch, turn in zip(slot.step, self.step, strict=False):
            found["sync_s" if isinstance(turn, Sync) else "switch_s"] += \
                self.seconds(switch, turn)
        return found

    def figures(self) -> dict[str, Any]:
        """The predicted figures a run is checked against (see `check`)."""
        seconds = [self.slot_seconds(s) for s in self.slots]
        slowest = max(seconds, key=lambda s: s["switch_s"] + s["sync_s"],
                      default={"switch_s": 0.0, "sync_s": 0.0})
        backups = sum(self._host_copies(s) for s in self.slots)
        return {"bytes_moved_per_step": sum(s.moved_per_step() for s in self.slots),
                "switch_s_per_step": slowest["switch_s"], "sync_s_per_step": slowest["sync_s"],
                "switch_time_per_step_s": slowest["switch_s"] + slowest["sync_s"],
                "peak_slot_bytes": max((s.peak_bytes() for s in self.slots), default=0),
                "host_backup_bytes": backups,
                "peak_host_bytes": backups + self.host_other_bytes}

    def _host_copies(self, slot: SlotForecast) -> int:
        if not self.pinned:
            return slot.backup_peak_bytes()
        copied = {(m.tenant, m.stage): m.nbytes for s in slot.start + slot.first_step
                  + slot.step for m in s.slept if m.copied}
        return sum(copied.values())

    @property
    def fits(self) -> bool:
        return not self.why

    @property
    def why(self) -> str:
        """Why the run does not fit ("" when it does): the first slot whose turns could not
        be made, or the host's memory."""
        for index, slot in enumerate(self.slots):
            if not slot.fits:
                return f"slot {index}: {slot.why}"
        figures = self.figures()
        to_disk = max((s.to_disk for slot in self.slots
                       for s in slot.start + slot.first_step + slot.step), default=0)
        if self.pinned and to_disk:  # the memory layer's CUDA backend refuses it
            hosts = max(1, len(self.slots) // self.slots_per_host)
            return (f"the host: its memory for backups is short, so {to_disk} bytes of "
                    f"them would go to disk, which CUDA tags' backups cannot yet: give "
                    f"each host {-(-figures['host_backup_bytes'] // hosts)} bytes for "
                    f"backups (run.host_memory), or let fewer stages sleep")
        if self.host_capacity_bytes is not None \
                and figures["peak_host_bytes"] > self.host_capacity_bytes:
            return (f"the host: {figures['peak_host_bytes']} bytes at the peak "
                    f"({figures['host_backup_bytes']} of backups, {self.host_other_bytes} "
                    f"besides) over its capacity of {self.host_capacity_bytes}")
        return ""

    def as_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data: the predicted figures, each slot's tenants (bytes
        per stage), its capacity and the steady step's switches, the rates."""
        slots = []
        for slot in self.slots:
            slots.append({
                "capacity_bytes": slot.capacity, "fits": slot.fits, "why": slot.why,
                "tenants": {t.name: {"stages": {s: {"bytes": b, "kept": k}
                                                for s, (b, k) in t.stages.items()},
                                     "working_bytes": t.working_bytes}
                            for t in slot.tenants},
                "peak_bytes": slot.peak_bytes(), "backup_peak_bytes": slot.backup_peak_bytes(),
                "moved_per_step": slot.moved_per_step(),
                "step": [_switch(s, self.seconds(s, t)) for s, t in zip(
                    slot.step, self.step, strict=False)],
                "first_step": [_switch(s, self.seconds(s, t)) for s, t in zip(
                    slot.first_step, self.step, strict=False)]})
        return {"policy": self.policy, "fits": self.fits, "why": self.why,
                "predicted": self.figures(), "host_capacity_bytes": self.host_capacity_bytes,
                "host_other_bytes": self.host_other_bytes, "pinned": self.pinned,
                "slots_per_host": self.slots_per_host,
                "slots": slots, "rates": vars(self.rates), **self.notes}


def _switch(switch: Switch, seconds: float) -> dict[str, Any]:
    return {"turn": switch.turn, "way": switch.way, "seconds": seconds,
            "slept": [f"{m.tenant}/{m.stage} {_copy(m, 'dropped')} {m.nbytes}"
                      for m in switch.slept],
            "woken": [f"{m.tenant}/{m.stage} {_copy(m, 'refilled')} {m.nbytes}"
                      for m in switch.woken],
            "copied_out": switch.copied_out, "copied_in": switch.copied_in,
            "to_disk": switch.to_disk, "from_disk": switch.from_disk,
            "discarded": switch.discarded, "refilled": switch.refilled,
            "in_slot_bytes": switch.in_slot_bytes, "tensors": switch.tensors,
            "disk_stages": switch.disk_stages,
            "peak_bytes": switch.peak_bytes, "backup_bytes": switch.backup_bytes}


def _copy(moved: Moved, otherwise: str) -> str:
    if not moved.copied:
        return otherwise
    return "copied" if moved.place == HOST else f"copied ({moved.place})"


def plan_run(slots: Sequence[Sequence[TenantSpec]], step: Sequence[Turn],
             capacity: int | None, rates: Rates, policy: str | Policy = "budget",
             start: Sequence[Turn] = (), host_capacity_bytes: int | None = None,
             host_other_bytes: int = 0, pinned: bool = False,
             slots_per_host: int | None = None, host_budget: int | None = None,
             backup_dir: str | None = None) -> Plan:
    """The plan of a run whose slots hold `slots` (each: its tenants, in the order they
    are spawned), each of `capacity` bytes, `slots_per_host` on each host (default: all on
    one), taking `step`'s turns every step after the `start` turns (see module). With
    `host_budget`, the host memory its arbiter lets the backups take (split evenly between
    its slots), the backups past it go to disk (`backup_dir`), as the run's do."""
    per_host = slots_per_host or len(slots)
    share = None if host_budget is None else host_budget // max(1, per_host)
    forecasts = [forecast_slot(tenants, step, capacity, policy, start, host_capacity=share,
                               backup_dir=backup_dir) for tenants in slots]
    name = policy if isinstance(policy, str) else type(policy).__name__
    return Plan(forecasts, list(step), rates, name, host_capacity_bytes, host_other_bytes,
                pinned, per_host)


def relative_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured; 0 when both are 0, +-1 when only measured is."""
    if measured == 0:
        return 0.0 if predicted == 0 else (1.0 if predicted > 0 else -1.0)
    return (predicted - measured) / measured


def check(predicted: dict[str, float], measured: dict[str, float]) -> dict[str, Any]:
    """Each figure of `TARGETS` found in both: predicted, measured, the signed relative
    error, the target and whether it holds; `off` lists those that do not, in words."""
    found: dict[str, Any] = {}
    off = []
    for name, target in TARGETS.items():
        if name not in predicted or name not in measured:
            continue
        error = relative_error(predicted[name], measured[name])
        found[name] = {"predicted": predicted[name], "measured": measured[name],
                       "error": error, "target": target, "within": abs(error) <= target}
        if abs(error) > target:
            off.append(f"{name}: predicted {predicted[name]:.6g}, measured "
                       f"{measured[name]:.6g}, off by {error:+.1%} (target {target:.0%})")
    found["off"] = off
    return found
