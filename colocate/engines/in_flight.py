"""`InFlight`: a generator's continuous calls not yet answered, and the gate that guards
them. What must not run beside a call (a sleep, a weight load, a whole-batch call) waits
inside `idle()` until none is in flight, and holds the gate meanwhile, so none starts."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class InFlight:
    """The continuous calls in flight (`started`, `ended`) under `gate`."""

    def __init__(self) -> None:
        self.gate = threading.Condition()  # guards the calls' state, the caller's too
        self.count = 0

    def started(self) -> None:
        """A call was taken (the caller holds `gate`)."""
        self.count += 1

    def ended(self, *_: object) -> None:
        """A call was answered (any arguments, as a callback gets them, are ignored)."""
        with self.gate:
            self.count -= 1
            self.gate.notify_all()

    @contextmanager
    def idle(self) -> Iterator[None]:
        """Once no call is in flight, hold the gate: none starts meanwhile."""
        with self.gate:
            self.gate.wait_for(lambda: self.count == 0)
            yield
