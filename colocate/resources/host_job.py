"""`HostJob`, what `start_hosts` gives back (N Monarch hosts and how to stop them), and the
wait for a host mesh to answer that every launch ends with.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported lazily: a GPU slot's proc imports the resources at bootstrap
    from monarch.actor import HostMesh

logger = logging.getLogger(__name__)


class HostStartError(RuntimeError):
    """The hosts did not come up (in time); the message says where their logs are."""

    def __init__(self, message: str, *, handle: str | None = None, logs: str | None = None):
        super().__init__(message)
        self.handle = handle  # the torchx app handle, if any
        self.logs = logs  # where the workers' logs are (kept after a failed start)


@dataclass
class HostJob:
    """N Monarch hosts (``mesh``) started by ``start_hosts``; ``stop()`` ends them."""

    mesh: HostMesh
    scheduler: str
    num_hosts: int
    handle: str | None = None  # the torchx app handle, for torchx schedulers
    logs: str | None = None  # where the workers' logs are, when known
    nodes: tuple[str, ...] = ()  # each host's node, where the scheduler names them (Slurm)
    _kill: Callable[[], None] | None = field(default=None, repr=False)
    _answers: Callable[[int], bool] | None = field(default=None, repr=False)
    _owns_hosts: bool = field(default=True, repr=False)
    _stopped: bool = field(default=False, repr=False)

    def stop(self, grace_s: float = 5.0) -> None:
        """Shut the hosts down (gracefully, for up to `grace_s`), then kill what is left.
        Idempotent; a no-op for the "local" host, which this job did not start."""
        if self._stopped:
            return
        self._stopped = True
        try:
            if self._owns_hosts:
                try:
                    self.mesh.shutdown().get(timeout=grace_s)
                except Exception as e:  # dead or unreachable hosts: the kill below ends them
                    logger.info("graceful shutdown of %s hosts failed: %r", self.scheduler, e)
        finally:
            if self._kill is not None:
                self._kill()

    def answers(self, host: int) -> bool | None:
        """Whether host `host`'s worker still takes connections (None: not known here)."""
        return None if self._answers is None else self._answers(host)

    def __enter__(self) -> HostJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_initialized(mesh: HostMesh, timeout_s: float, scheduler: str, logs: str,
                      handle: str | None = None, check: Callable[[], None] | None = None) -> None:
    """Wait for the mesh to connect to all its hosts; `check()` (raising) every half second."""
    initialized = mesh.initialized  # a timed-out get() leaves it pending, to get() again
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            initialized.get(timeout=min(0.5, max(deadline - time.monotonic(), 0.0)))
            return
        except TimeoutError as e:
            if check is not None:
                check()
            if time.monotonic() >= deadline:
                app = f"app {handle}; " if handle else ""
                raise HostStartError(
                    f"{scheduler}: hosts did not answer within {timeout_s:.0f} s "
                    f"({app}worker logs: {logs})", handle=handle, logs=logs
                ) from e
        except HostStartError:
            raise
        except Exception as e:
            raise HostStartError(
                f"{scheduler}: hosts failed ({logs}): {e!r}", handle=handle, logs=logs
            ) from e
