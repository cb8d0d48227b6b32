"""What this process's pauses and resumes moved: bytes copied to a tag's host backup at a
pause, copied back at a resume, and dropped by pauses of tags without backup.

The registry counts every transition here; a switch's plan reads the counter before and
after it runs (`Traffic.since`), so the arbiter knows what each switch really moved.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Traffic:
    """Bytes moved between a slot's memory and its host backup, and bytes discarded."""

    copied_out: int = 0  # paused with backup: saved to host memory
    copied_in: int = 0  # resumed with backup: restored from host memory
    discarded: int = 0  # paused without backup: dropped, refilled by their owner

    @property
    def copied(self) -> int:
        """Bytes that crossed the host link, both ways."""
        return self.copied_out + self.copied_in

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.copied_out + other.copied_out, self.copied_in + other.copied_in,
                       self.discarded + other.discarded)

    def since(self, earlier: Traffic) -> Traffic:
        """What moved between `earlier` and this reading."""
        return Traffic(self.copied_out - earlier.copied_out,
                       self.copied_in - earlier.copied_in, self.discarded - earlier.discarded)


class TrafficCounter:
    """The running totals of one process (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = Traffic()

    def paused(self, nbytes: int, backup: bool) -> None:
        moved = Traffic(copied_out=nbytes) if backup else Traffic(discarded=nbytes)
        with self._lock:
            self._total += moved

    def resumed(self, nbytes: int, backup: bool) -> None:
        if backup:
            with self._lock:
                self._total += Traffic(copied_in=nbytes)

    def total(self) -> Traffic:
        with self._lock:
            return self._total
