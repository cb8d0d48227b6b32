"""One replica of a service: its procs, its actors (a tenant of the arbiter), its state
and its load.

A replica's state is one `ReplicaState`; `move` checks each transition:

    STARTING -> HEALTHY | STOPPED           its actors started, or could not
    HEALTHY -> DRAINING -> STOPPED          scaled down or shut down
    HEALTHY | DRAINING -> FAILED            its proc died, or its actors failed
    FAILED -> RECOVERING -> HEALTHY         respawned on new procs for the same slots
    RECOVERING -> FAILED                    the respawn failed
    FAILED -> STOPPED                       removed while failed

Only a HEALTHY replica takes calls. When it fails, its calls in flight end at once with
`ReplicaLostError` (the service retries them elsewhere) instead of waiting for Monarch to
give up on a dead proc; its next generation starts with a clean slate. Its tenant name
(the arbiter's key, the mesh's name) is made from its fields, the service's name, its
index and its generation (how many times it was respawned), and never read back.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from colocate.abortable import Abortable
from colocate.resources.groups import Allocation
from services.errors import ReplicaLostError
from services.waiting import Changes


class ReplicaState(enum.Enum):
    STARTING = "starting"  # its actors are being spawned
    HEALTHY = "healthy"  # takes calls
    DRAINING = "draining"  # leaving: takes no new calls, finishes those in flight
    FAILED = "failed"  # its proc died or its actors failed; `failure` says how
    RECOVERING = "recovering"  # failed, and being respawned on new procs
    STOPPED = "stopped"  # removed, its procs given back


MOVES: dict[ReplicaState, set[ReplicaState]] = {
    ReplicaState.STARTING: {ReplicaState.HEALTHY, ReplicaState.STOPPED},
    ReplicaState.HEALTHY: {ReplicaState.DRAINING, ReplicaState.FAILED},
    ReplicaState.DRAINING: {ReplicaState.STOPPED, ReplicaState.FAILED},
    ReplicaState.FAILED: {ReplicaState.RECOVERING, ReplicaState.STOPPED},
    ReplicaState.RECOVERING: {ReplicaState.HEALTHY, ReplicaState.FAILED},
    ReplicaState.STOPPED: set(),
}


def tenant_name(service: str, index: int, generation: int) -> str:
    """The spawn name of replica `index` of `service` in its `generation` (0: first start)."""
    name = f"{service}_r{index}"
    return f"{name}_g{generation}" if generation else name


class ReplicaStateError(RuntimeError):
    """A replica was asked to move to a state it cannot reach from its own (a bug in the
    caller: the message names both states and the replica)."""


@dataclass
class Replica:
    service: str  # the service's name
    index: int
    allocation: Allocation
    changes: Changes  # the service's: told of every state change and finished call
    actors: Any = None  # Monarch ActorMesh over the replica's procs, once started
    state: ReplicaState = ReplicaState.STARTING
    failure: str | None = None
    generation: int = 0  # how many times it was respawned (0: its first start)
    in_flight: int = 0
    served: int = 0  # calls that returned a result, all generations
    failed: int = 0  # calls that raised (the endpoint's own error, the replica lost...)
    busy_s: float = 0.0  # time spent in its finished calls, all generations
    calls: Abortable = field(default_factory=Abortable)  # this generation's calls in flight

    @property
    def tenant(self) -> str:
        """The name its actors are spawned under (the arbiter's key for them)."""
        return tenant_name(self.service, self.index, self.generation)

    @property
    def procs(self) -> int:
        return len(self.allocation.slots)

    def move(self, state: ReplicaState, failure: str | None = None) -> None:
        """Go to `state` (recording `failure` for FAILED), and tell the service."""
        if state not in MOVES[self.state]:
            raise ReplicaStateError(f"replica {self.index} of service {self.service!r} "
                                    f"cannot go from {self.state.value} to {state.value}")
        self.state = state
        if failure is not None or state is ReplicaState.HEALTHY:
            self.failure = failure
        if state is ReplicaState.FAILED:
            self.calls.abort(lambda: ReplicaLostError(
                f"replica {self.index} of service {self.service!r} failed while this call was "
                f"in flight: {self.failure}"))
        elif state is ReplicaState.HEALTHY and self.calls.aborted:
            self.calls = Abortable()  # a new generation
        self.changes.notify()

    async def call(self, endpoint: str, args: tuple, kwargs: dict) -> Any:
        """Call `endpoint` on every proc of the replica; the result of its rank 0. Counted
        as `served` or `failed` (a cancelled call as neither)."""
        method = getattr(self.actors, endpoint)
        self.in_flight += 1
        start = time.monotonic()
        try:
            if self.procs == 1:
                result = await self.calls.run(method.call_one(*args, **kwargs))
            else:
                results = await self.calls.run(method.call(*args, **kwargs))
                result = next(iter(results.items()))[1]
        except Exception:
            self.failed += 1
            raise
        else:
            self.served += 1
            return result
        finally:
            self.in_flight -= 1
            self.busy_s += time.monotonic() - start
            self.changes.notify()
