"""Getting a slot's plan carried out where the memory is, and its one answer back.

`Courier.carry_out(slot, steps, log)` splits the steps by process (colocated tenants share
one, so a switch is one segment: one message), and for each segment, in order:

- tenants on Monarch procs (their handle has `run_plan`): one `run_plan` message to a
  tenant actor of that process, the first step's tenant by preference (its mailbox orders
  the plan after its own calls in flight; `TenantActor` makes the plan wait for the other
  tenants' calls), with the plan's deadline. While it waits the arbiter watches the
  process; if it dies, or the answer is late, the step it was at is read from the
  process's progress file, and its tenants are lost: a proc that did not answer within
  `ArbiterConfig.call_timeout_s` is taken for hung and killed (`kill_hung`), so that its
  group restarts as after a crash, not a switch waiting on it again. Later plans of the
  same request for that process (the rollback) go to the same actor.
- tenants of the arbiter's own process (`LocalTenantHandle`, test handles): the plan's
  steps run here, each call watched the same way.

It never raises for a failed step: the answer's `failure` says where and why, for the
arbiter to roll back (undo.py) and explain. Also here: the watched call (`watched`) and
the loss of a proc's tenants (`lose`), which the arbiter uses for its other calls too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from colocate import memory, telemetry, watching
from colocate.arbiter.config import ArbiterConfig
from colocate.arbiter.errors import ArbiterTimeoutError, TenantLostError
from colocate.arbiter.plan import (
    At,
    Call,
    Failure,
    Plan,
    PlanResult,
    Read,
    Step,
    Wait,
    execute,
    read_progress,
)
from colocate.arbiter.slot import Slot
from colocate.arbiter.undo import UndoLog
from colocate.shm_files import forget_progress

T = TypeVar("T")
LIVENESS_POLL_S = 0.05  # how often a pending call checks that its tenant's proc runs
AFTER_LOSS = ("To use slot {slot} again, remove its lost tenants (rm.remove) and give it new "
              "procs (rm.release(group), then allocate again)")


def lose(slot: Slot, pid: int, during: str, why: str | None = None) -> TenantLostError:
    """Mark every tenant of process `pid` on `slot` lost (asleep: a dead process holds
    nothing), and return the error that says so (`why`: other than that it died)."""
    why = why or f"its proc, pid {pid}, died during {during}"
    names = [n for n, info in slot.infos.items() if info.pid == pid]
    for name in names:
        slot.lost.setdefault(name, why)
        slot.unknown.discard(name)
        slot.mark(name, ())
    forget_progress(pid)
    return TenantLostError(f"{' and '.join(names)} lost on slot {slot.index}: {why}. "
                           + AFTER_LOSS.format(slot=slot.index), slot.index, tuple(slot.lost))


def kill_hung(slot: Slot, pid: int, during: str, timeout_s: float) -> TenantLostError:
    """Process `pid` did not answer within `timeout_s` at `during`: SIGKILL it (a stopped
    one too; the arbiter runs on the slots' host) and lose its tenants."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return lose(slot, pid, during, f"its proc, pid {pid}, did not answer within {timeout_s} "
                f"s at {during} (hung) and was killed")


async def watched(timeout_s: float, what: str | Callable[[], str], call: Awaitable[T],
                  slot: Slot | None = None, name: str | None = None) -> T:
    """`call`'s answer within `timeout_s`. For a call to tenant `name` of `slot`, the
    tenant's proc is watched meanwhile (`colocate.watching`): if it dies, its tenants are
    lost at once. `what` names the call in errors (a function: asked when an error needs
    it)."""
    pid = slot.infos[name].pid if slot is not None and name is not None else None

    def said() -> str:
        return what() if callable(what) else what

    async def check() -> None:
        if pid is not None and slot is not None and not telemetry.process_runs(pid):
            raise lose(slot, pid, said())

    async def late() -> BaseException:
        return ArbiterTimeoutError(f"{said()} did not answer within {timeout_s} s")

    return await watching.watched(call, LIVENESS_POLL_S, check, timeout_s, late,
                                  check_first=True)


def reading(slot: Slot, name: str, during: str) -> telemetry.MemoryReading:
    """The memory of `name`'s process, read from here: its RSS (CPU), or its share of its
    GPU where NVML gives per-process usage. A process that died loses its tenants."""
    info = slot.infos[name]
    try:
        if info.device == "cpu":
            found = telemetry.read_pid(info.pid)
        else:
            found = telemetry.read_gpu_uuid_process(info.device, info.pid)
    except telemetry.TelemetryError:
        if not telemetry.process_runs(info.pid):
            raise lose(slot, info.pid, during) from None
        raise
    if not telemetry.process_runs(info.pid):  # a dying process reads as released: it is lost
        raise lose(slot, info.pid, during)
    return found


class Courier:
    """Carries out plans on a host's slots (see module)."""

    def __init__(self, config: ArbiterConfig) -> None:
        self.config = config
        self._ids = itertools.count(random.randrange(1 << 30))  # plan ids: new per run

    def plan(self, steps: list[Step], remote: bool) -> Plan:
        c = self.config
        return Plan(tuple(steps), c.release_fraction, c.release_timeout_s,
                    c.min_verified_bytes,
                    time.monotonic() + c.call_timeout_s if remote else None, next(self._ids),
                    c.backup_dir)

    async def carry_out(self, slot: Slot, steps: list[Step], log: UndoLog) -> PlanResult:
        """Run `steps` on `slot`'s procs, a segment per process in order; one answer."""
        total = PlanResult()
        offset = 0
        for pid, segment in _segments(slot, steps):
            runner = self._runner(slot, pid, segment[0].tenant, log)
            if runner is None:
                part = await self._run_here(slot, self.plan(segment, remote=False))
            else:
                part = await self._send(slot, runner, self.plan(segment, remote=True))
            total.done = offset + part.done
            total.copied += part.copied
            total.moved += part.moved
            total.infos.update(part.infos)
            total.unknown += part.unknown
            total.backups.update(part.backups)
            if part.failure is not None:
                part.failure.index += offset
                total.failure = part.failure
                break
            offset += len(segment)
        return total

    @staticmethod
    def _runner(slot: Slot, pid: int, first: str, log: UndoLog) -> str | None:
        """The tenant actor that runs this request's plans in process `pid`: the one used
        before in the request, else `first` or another live tenant of that process; None
        when the tenants are reached in this process (their handles have no `run_plan`)."""
        if (slot.index, pid) in log.runners:
            return log.runners[(slot.index, pid)]
        if not hasattr(slot.tenants[first], "run_plan"):
            return None
        others = [n for n, info in slot.infos.items() if info.pid == pid and n != first]
        runner = next((n for n in (first, *others) if n not in slot.lost
                       and getattr(slot.tenants[n], "lost", None) is None), first)
        log.runners[(slot.index, pid)] = runner
        return runner

    async def _send(self, slot: Slot, runner: str, plan: Plan) -> PlanResult:
        """The plan as one message to tenant actor `runner`; its failures as answers."""
        pid = slot.infos[runner].pid

        seen: list[tuple[int, str]] = []

        def where() -> tuple[int, str]:
            """The step the plan is at, read once (a loss removes the progress file)."""
            if not seen:
                reached = read_progress(pid, plan.id)
                seen.append((0, f"{runner}'s calls in flight, before the plan's first step")
                            if reached is None
                            else (reached[0], plan.steps[reached[0]].label(reached[1])))
            return seen[0]

        try:
            return await watched(self.config.call_timeout_s, lambda: where()[1],
                                 slot.tenants[runner].run_plan(plan), slot, runner)
        except TenantLostError as err:
            index, label = where()
            return PlanResult(done=index, failure=Failure(index, label, "lost", str(err),
                                                          error=err))
        except ArbiterTimeoutError:
            index, label = where()
            lost = kill_hung(slot, pid, label, self.config.call_timeout_s)
            return PlanResult(done=index, failure=Failure(index, label, "lost", str(lost),
                                                          error=lost))
        except Exception as err:  # Monarch reports the actor or its proc failed
            index, label = where()
            if not telemetry.process_runs(pid):
                lost = lose(slot, pid, label)
                return PlanResult(done=index, failure=Failure(index, label, "lost", str(lost),
                                                              error=lost))
            return PlanResult(done=index, failure=Failure(index, label, "raised",
                                                          str(err) or type(err).__name__,
                                                          error=err))

    async def _run_here(self, slot: Slot, plan: Plan) -> PlanResult:
        """The plan's steps run from here, each tenant call watched (see module)."""
        steps, moved = execute(plan), memory.traffic()
        memory.set_backup_dir(plan.backup_dir)
        label = plan.steps[0].label() if plan.steps else ""
        answer: Any = None
        thrown: BaseException | None = None
        while True:
            try:
                op = steps.throw(thrown) if thrown is not None else steps.send(answer)
            except StopIteration as stop:
                result: PlanResult = stop.value
                if result.failure is not None and isinstance(result.failure.error,
                                                             TenantLostError):
                    result.failure.kind = "lost"
                result.moved = memory.traffic().since(moved)  # its tenants live here
                result.backups = {os.getpid(): memory.backup_reading(reset_peak=True)}
                return result
            answer, thrown = None, None
            try:
                if isinstance(op, At):
                    label = plan.steps[op.index].label(op.phase)
                elif isinstance(op, Call):
                    answer = await self._call_here(slot, op, label)
                elif isinstance(op, Read):
                    answer = reading(slot, op.tenant, label).used_bytes
                elif isinstance(op, Wait):
                    await asyncio.sleep(op.seconds)
            except Exception as err:
                thrown = err

    async def _call_here(self, slot: Slot, op: Call, label: str) -> Any:
        if op.tenant in slot.lost:
            raise TenantLostError(f"{op.tenant} is lost on slot {slot.index} "
                                  f"({slot.lost[op.tenant]})", slot.index, tuple(slot.lost))
        handle = slot.tenants[op.tenant]
        return await watched(self.config.call_timeout_s, label,
                             getattr(handle, op.method)(*op.args), slot, op.tenant)


def _segments(slot: Slot, steps: list[Step]) -> list[tuple[int, list[Step]]]:
    """`steps` cut where the process changes: (pid, its steps), in order."""
    found: list[tuple[int, list[Step]]] = []
    for step in steps:
        pid = slot.infos[step.tenant].pid
        if found and found[-1][0] == pid:
            found[-1][1].append(step)
        else:
            found.append((pid, [step]))
    return found


def find_lost(slots: Iterable[Slot], names: Iterable[str]) -> dict[str, str]:
    """Check now that the procs of `names` run; those that died are lost from here on.
    Returns every lost tenant on the slots of `names`, with why."""
    names = set(names)
    found: dict[str, str] = {}
    for slot in slots:
        asked = names.intersection(slot.tenants)
        if not asked:
            continue
        for name in asked.difference(slot.lost):
            pid = slot.infos[name].pid
            if not telemetry.process_runs(pid):
                lose(slot, pid, "a liveness check")
        found.update({name: f"{name} lost on slot {slot.index}: {why}"
                      for name, why in slot.lost.items()})
    return found
