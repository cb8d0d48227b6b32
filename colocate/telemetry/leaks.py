"""Leak tracking: warn when the memory left after pausing a tag keeps growing cycle after cycle."""

from __future__ import annotations

import threading
import warnings
from collections import deque
from dataclasses import dataclass, field

KIB = 1 << 10
MIB = 1 << 20

# The steady growth per cycle (one pause of a tag) that is not counted as a leak: 64 KiB a
# cycle. The runtime grows without any tenant leaking: Monarch 0.7.0 keeps native memory
# for each message a proc handles (bench/monarch_growth.py), so 64 KiB a cycle allows about
# 160 messages between two pauses of a tag, while a tensor of 1 MiB a cycle kept outside its
# tag is 16 times it. A proc that handles more messages than that between two pauses of a
# tag needs a larger value. (The measurements: bench/RESULTS.md, "Where the telemetry
# defaults come from".)
DRIFT_BYTES_PER_CYCLE = 64 * KIB


class ResidualGrowthWarning(UserWarning):
    """The residual memory after pausing a tag grew faster than the allowed drift for
    several cycles in a row."""


@dataclass
class _TagState:
    recent: deque[int]  # the last `span` + 1 residuals
    # the largest rise from one pause to the next among those residuals, as a sliding-window
    # maximum: (observation, rise), the rises decreasing, so each pause costs O(1) amortised
    # where a pass over the `span` residuals cost ~0.1 ms a pause (bench/RESULTS.md, soak)
    rises: deque[tuple[int, int]] = field(default_factory=deque)
    baseline: int | None = None  # the residual at pause warmup + 1
    cycles: int = 0  # pauses observed since the baseline (the baseline's own is 0)
    observed: int = 0  # pauses observed since the last reset, warm-up included
    streak: int = 0  # consecutive observations above the allowance
    warned: bool = False


class LeakTracker:
    """Compares each tag's post-pause residual with two references: its baseline, the
    residual after the first `warmup` pauses of that tag (a process's first cycles grow its
    heap and allocator pools once, which is no leak), and the residual `span` pauses ago.

    Against a reference k pauses back, the residual counts as grown when it exceeds
    reference + max(tolerance_bytes, tolerance_fraction * reference) + k *
    drift_bytes_per_cycle. So noise, and steady growth below `drift_bytes_per_cycle` a pause
    (the runtime's own, see DRIFT_BYTES_PER_CYCLE), never warn; steady growth faster than
    that warns in the end, against the baseline. Against the recent reference, where the
    largest rise from one pause to the next is left out (a one-off step), growth faster than
    drift_bytes_per_cycle + tolerance_bytes / span a pause warns within about `span` pauses,
    however long the run went before it began (against the baseline alone, the allowance
    left unused over a long run would let it grow that much first). After `window` grown
    observations in a row the tracker emits one ResidualGrowthWarning for the tag, and stays
    quiet about it until `reset`.
    """

    def __init__(
        self,
        tolerance_bytes: int = 8 << 20,
        tolerance_fraction: float = 0.01,
        window: int = 3,
        warmup: int = 0,
        drift_bytes_per_cycle: int = DRIFT_BYTES_PER_CYCLE,
        span: int = 256,
    ) -> None:
        if min(tolerance_bytes, tolerance_fraction, warmup, drift_bytes_per_cycle) < 0:
            raise ValueError("LeakTracker tolerances, drift and warmup must be >= 0")
        if window < 1 or span < 1:
            raise ValueError(f"LeakTracker window and span must be >= 1, not {window}, {span}")
        self.tolerance_bytes = tolerance_bytes
        self.tolerance_fraction = tolerance_fraction
        self.window = window
        self.warmup = warmup
        self.drift_bytes_per_cycle = drift_bytes_per_cycle
        self.span = span
        self._lock = threading.Lock()
        self._tags: dict[str, _TagState] = {}

    def _grown(self, residual: int, reference: int, cycles: int, floor: int) -> bool:
        tolerance = max(self.tolerance_bytes, floor, self.tolerance_fraction * reference)
        return residual > reference + tolerance + cycles * self.drift_bytes_per_cycle

    def observe(self, tag: str, residual_bytes: int, min_tolerance_bytes: int = 0) -> None:
        """Record the memory measured right after a pause of `tag`; warn on sustained growth.
        `min_tolerance_bytes` raises the tolerance for this observation (a device-wide GPU
        reading, which other processes move too)."""
        with self._lock:
            state = self._tags.get(tag)
            if state is None:
                state = self._tags[tag] = _TagState(deque(maxlen=self.span + 1))
            state.observed += 1
            if state.recent:
                rise = residual_bytes - state.recent[-1]
                while state.rises and state.rises[-1][1] <= rise:
                    state.rises.pop()
                state.rises.append((state.observed, rise))
                while state.rises[0][0] <= state.observed - self.span:
                    state.rises.popleft()  # its earlier residual left `recent`
            state.recent.append(residual_bytes)
            if state.observed <= self.warmup:
                return
            if state.baseline is None:
                state.baseline = residual_bytes
            else:
                state.cycles += 1
            grown = self._grown(residual_bytes, state.baseline, state.cycles,
                                min_tolerance_bytes)
            if state.cycles > self.span:
                # continuing growth over the last `span` pauses, less the largest rise from
                # one pause to the next: a one-off step (a table of the runtime doubling, a
                # cache filled once) is no leak there, a steady rise is
                step = max(0, state.rises[0][1])
                grown = grown or self._grown(residual_bytes - step, state.recent[0], self.span,
                                             min_tolerance_bytes)
            state.streak = state.streak + 1 if grown else 0
            if state.streak < self.window or state.warned:
                return
            state.warned = True
            baseline, cycles, observed = state.baseline, state.cycles, state.observed
        rate = (residual_bytes - baseline) / max(cycles, 1)
        warnings.warn(
            f"residual memory after pausing tag {tag!r} grew from {baseline} B (pause "
            f"{self.warmup + 1}) to {residual_bytes} B (pause {observed}, "
            f"+{(residual_bytes - baseline) / MIB:.1f} MiB, {rate / KIB:.1f} KiB a pause "
            f"against {self.drift_bytes_per_cycle / KIB:.0f} KiB allowed), above tolerance "
            f"for {self.window} pauses in a row; check for tensors allocated outside "
            f"{tag!r}'s region that outlive a cycle, and for caches that grow each cycle "
            "(torch's caching allocator, KV/prefix caches, memoised state)",
            ResidualGrowthWarning,
            stacklevel=2,
        )

    def history(self, tag: str) -> list[int]:
        """The residuals observed for `tag` since its last reset, oldest first: the last
        `span` + 1 of them."""
        with self._lock:
            state = self._tags.get(tag)
            return list(state.recent) if state else []

    def reset(self, tag: str | None = None) -> None:
        """Forget `tag` (every tag when None): the next observation after the warm-up
        becomes its new baseline."""
        with self._lock:
            if tag is None:
                self._tags.clear()
            else:
                self._tags.pop(tag, None)


# The default tracker waits out the first 10 cycles (a proc's residual climbs while its
# caches fill) and then allows 16 MiB of swing before growth counts (bench/RESULTS.md,
# "Where the telemetry defaults come from").
_default = LeakTracker(tolerance_bytes=16 << 20, warmup=10)


def leak_tracker() -> LeakTracker:
    """The process-wide tracker that the runtime feeds after each pause."""
    return _default
