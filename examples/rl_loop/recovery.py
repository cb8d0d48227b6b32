"""Going on after a lost proc: the run's own part of a group restart.

When a slot proc dies, the runtime restarts the trainer's resource group
(`ServiceConfig(restart="group")`, `services.restart`): every proc of the group replaced,
the trainer and the generator spawned again on them in their spawn order, so they share a
process again. This module does what only the loop can do around that:

1. the restart's hook cancels the step under way, before its held calls could reach the
   new generation (they would train the restored trainer on a stale batch);
2. once the group is back, the trainer loads the newest complete checkpoint (none yet: it
   keeps the weights it started with), the generator gets them, and the loop's state goes
   back to that checkpoint's;
3. the restart is recorded (step, cause, seconds lost, steps redone), and the loop goes on
   from the checkpoint's step. Because a resumed run is the same run, the steps redone give
   the metrics they gave before.

A lost host (its worker gone: a Slurm task killed, a node set down; the runtime's proc
watch sees it within a second and names it, `colocate.resources.lost_hosts`) cannot come
back in place: the run stops what is left of its runtime and asks the scheduler for
`run.hosts` new hosts (Slurm leaves the lost host's node out), spawns its services there
(`Runtime.replace_hosts`), and goes on as after a group restart, from the newest complete
checkpoint. When none come within `run.host_timeout_s`, the run stops with
`HostsLostError`, naming the host lost and what it waited for; `run.resume=auto` on a new
allocation finishes it.

A failure with no restart behind it (an endpoint's own error), a restart that failed, or
more than `run.max_restarts` restarts end the run with the cause.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from colocate.resources.host_job import HostStartError
from colocate.resources.lost_hosts import LostHost
from examples.rl_loop.config import RLConfig
from examples.rl_loop.record import RunRecord
from examples.rl_loop.rollouts import Rollouts
from examples.rl_loop.saves import Saves
from examples.rl_loop.state import LoopState, identity
from services import RestartEvent
from services.restart import GroupRestarts

logger = logging.getLogger(__name__)
RESTART_SEEN_S = 3.0  # a failed step waits this long for its group's restart to begin


class Recovering(Protocol):
    """What the recovery uses of the loop (`loop.Loop`)."""

    cfg: RLConfig
    record: RunRecord
    saves: Saves
    sampler: Any  # the task's prompt sampler: state_dict() / load_state_dict()
    sampler_start: dict[str, Any]  # its state before any step
    rollouts: Rollouts

    async def load(self, checkpoint: Path | None) -> None: ...


class Hosts(Protocol):
    """What the recovery uses of the runtime (`runtime.Runtime`) after a lost host."""

    def lost_hosts(self) -> list[LostHost]: ...

    async def replace_hosts(self) -> dict[str, float]: ...


@dataclass(frozen=True)
class Restarted:
    """What brought the run's services back: a group restart, or new hosts."""

    cause: str
    detected_at: float  # time.time() when the failure was seen
    seconds: float  # from then until the services were back
    hosts: dict[str, Any] | None = None  # after a lost host: the new hosts' start


class Recovery:
    """The loop's side of its trainer group's restarts, once it `follow`s them."""

    restarts: GroupRestarts
    hosts: Hosts

    def __init__(self, loop: Recovering) -> None:
        self.loop = loop
        self.stepping: asyncio.Future | None = None  # the step under way
        self.events = 0  # restarts seen when the step under way began

    def follow(self, restarts: GroupRestarts, hosts: Hosts) -> None:
        """Go on after each of `restarts` (the trainer's group's, followed before its
        services are spawned), and after a host of `hosts` is lost: a restart first
        abandons the step under way."""
        self.restarts, self.hosts = restarts, hosts
        self.events = len(restarts.events)
        restarts.on_restart.append(self._abandon_step)

    async def run(self, step: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
        """Run one step, which a restart of the group may cancel."""
        self.events = len(self.restarts.events)
        self.stepping = asyncio.ensure_future(step)
        try:
            return await self.stepping
        finally:
            self.stepping = None

    async def _abandon_step(self, event: RestartEvent) -> None:
        self.abandon()

    def abandon(self, lost: LostHost | None = None) -> None:
        """Cancel the step under way (a host was `lost`: its calls to procs there may wait
        long for Monarch's own report of them)."""
        if self.stepping is not None:
            self.stepping.cancel()

    async def recover(self, index: int, failure: BaseException, again: int = 0) -> int:
        """Step `index` failed: when the trainer's group restarted for it, reload the newest
        complete checkpoint (none yet: the start) and return the step to go on from;
        otherwise raise the failure. A proc lost during the reload itself (`again`: how
        often so far) restarts the group once more, counted against run.max_restarts."""
        event = await self._restart_for(failure)
        self.events = len(self.restarts.events)  # a later restart is a new one
        loop, run = self.loop, self.loop.cfg.run
        record = loop.record
        if len(record.restarts) + again >= run.max_restarts:
            raise RuntimeError(f"a proc of the run was lost again after {run.max_restarts} "
                               f"restart(s) (run.max_restarts): {event.cause}") from failure
        if event.hosts is not None:
            event = await self._new_hosts(event, failure)
        found = loop.saves.checkpoints.complete()
        path = found[-1] if found else None
        state = LoopState.read(path / "loop.json") if path else LoopState(
            step=0, sampler=loop.sampler_start,
            identity=identity(record.config), metrics=record.steps[:1])
        loading = time.monotonic()
        try:
            await loop.load(path)
        except Exception as lost:  # its new procs were lost too: their group restarts again
            return await self.recover(index, lost, again + 1)
        redone = record.steps[len(state.metrics):]
        loop.sampler.load_state_dict(state.sampler)
        loop.rollouts.load_state_dict(state.carried)
        record.rewind(state)
        record.restart({
            "step": index, "resumed_at": state.step, "steps_redone": index - state.step,
            "cause": event.cause, "restart_s": event.seconds,
            "load_and_sync_s": time.monotonic() - loading,
            "seconds_lost": time.time() - event.detected_at
            + sum(row["step_s"] for row in redone), **(event.hosts or {})})
        logger.warning("restart %d: going on from step %d (%d step(s) to redo) after: %s",
                       len(record.restarts), state.step, index - state.step, event.cause)
        return state.step

    async def _restart_for(self, failure: BaseException) -> Restarted:
        """The restart of the trainer's group that `failure` came with, once it has ended,
        or the hosts lost with it (their replacement is `_new_hosts`'); `failure` itself
        when neither began within the proc watch's detection time."""
        deadline = time.monotonic() + RESTART_SEEN_S
        while not self.restarts.running and len(self.restarts.events) == self.events:
            if self.hosts.lost_hosts():
                return self._lost()
            if isinstance(failure, asyncio.CancelledError) or time.monotonic() > deadline:
                raise failure
            await asyncio.sleep(0.05)
        while self.restarts.running:  # a restart on a lost host is left to the shutdown
            if self.hosts.lost_hosts():
                return self._lost()
            await asyncio.wait({self.restarts.task}, timeout=0.1)
        event = self.restarts.events[-1]
        if self.hosts.lost_hosts():  # the restart failed on the lost host, or came first
            return self._lost()
        if event.error is not None:
            raise RuntimeError(f"the run's slots did not come back after a lost proc: "
                               f"{event.error}") from failure
        return Restarted(event.cause, event.detected_at, event.seconds)

    def _lost(self) -> Restarted:
        """The lost hosts as the restart's cause: the first seen, and those lost with it."""
        lost = self.hosts.lost_hosts()
        first, others = lost[0], [h.name for h in lost[1:]]
        cause = f"lost {first.name}: {first.why}" + (
            f" (lost with it: {', '.join(others)})" if others else "")
        return Restarted(cause, first.detected_at, 0.0, {"hosts_lost": [h.name for h in lost],
                                                          "lost_at": first.detected_at})

    async def _new_hosts(self, event: Restarted, failure: BaseException) -> Restarted:
        """The run on new hosts (`Runtime.replace_hosts`), or a one-line error naming what
        was lost and what it waited for when none came within `run.host_timeout_s`."""
        run = self.loop.cfg.run
        logger.warning("%s; asking %s for %d new host(s)", event.cause, run.scheduler, run.hosts)
        try:
            times = await self.hosts.replace_hosts()
        except HostStartError as err:
            waited = str(err).splitlines()[0]
            raise HostsLostError(
                f"{event.cause.split(':')[0]}; no replacement within run.host_timeout_s="
                f"{run.host_timeout_s:g} s: {waited}") from failure
        return Restarted(event.cause, event.detected_at, time.time() - event.detected_at,
                         {**(event.hosts or {}), **times})


class HostsLostError(RuntimeError):
    """A host of the run was lost and no replacement came within run.host_timeout_s."""
