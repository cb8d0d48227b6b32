"""A switch as a plan: the steps one proc carries out for the arbiter, and how it runs them.

The arbiter decides a switch's steps per slot (core.py, handoff_plan.py); each proc receives
the steps of its own tenants in one message (`Plan`), carries them out in order against
the tenants of its process (colocated tenants share it), measures each release itself
(its RSS on CPU, its share of the GPU by NVML), and answers once (`PlanResult`: how far it
got, the bytes copied, and where and why it stopped). A failed plan is not undone here:
the arbiter, which holds the request's undo log, sends the proc a plan of `restore` steps
(undo.py), which also answers with each restored tenant's own account.

`execute(plan)` is the plan's logic, free of I/O: a generator that yields what it needs
done (`Call` a tenant, `Read` the memory, `Wait`, mark progress `At` a step) and is sent
the answers (or has the error thrown in). Two drivers run it: `run_here`, in the tenants'
process (`TenantActor.run_plan`, synchronous), and the arbiter's own, for tenants of the
arbiter's process (`LocalTenantHandle`, local.py), which watches each call
(`Courier._run_here`, delivery.py).

Where a plan stopped must be known even when its proc dies or hangs mid-plan: before each
step (and each release check) `run_here` writes the plan's id and the step's index to a
small file of its own (`progress_path(pid)`, in /dev/shm), which the arbiter, on the same
host, reads when the proc died or did not answer in time. A plan carries a deadline (the
arbiter's, on the host's monotonic clock): once the arbiter stopped waiting, the proc
starts no further step, and the arbiter's restore plan, queued behind it, finds the
tenants as the plan left them.
"""

from __future__ import annotations

import atexit
import os
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from colocate import memory, telemetry
from colocate.arbiter.tenant import TenantInfo
from colocate.memory.backups import BackupReading
from colocate.memory.traffic import Traffic
from colocate.shm_files import forget_progress, progress_path

SLEEP, WAKE, RECEIVE, RESTORE = "sleep", "wake", "receive", "restore"
RELEASE_POLL_S = 0.002  # how often a release check reads the memory again


@dataclass(frozen=True)
class Step:
    """One tenant call of a plan.

    sleep: release `stages` (None: every awake stage), each kept one's contents at its
        place in `places` (stage -> host, disk or drop: `host_budget.py`; host when not
        named); with `verify`, the proc measures the release (at least `release_fraction`
        of the bytes the tenant says it held) before the next step. wake: bring back
        `stages`, in order. receive: copy the weights of tenant `source` into the tenant.
        restore: bring the tenant back to exactly `stages` awake (sleeps first, then
        wakes), whatever it holds now; answers its account.
    """

    op: str
    tenant: str
    stages: tuple[str, ...] | None = None
    verify: bool = False
    source: str = ""
    device: str = "cpu"  # where the tenant's memory lives: "cpu", or its GPU's UUID
    places: tuple[tuple[str, str], ...] = ()  # sleep: (stage, place) of its kept stages

    def label(self, phase: str = "call") -> str:
        """The step in words, as errors name it."""
        if self.op == SLEEP:
            call = f"{self.tenant}.sleep" + ("" if self.stages is None
                                              else f"({list(self.stages)})")
            return f"the release check of {call}" if phase == "release" else call
        if self.op == WAKE:
            return f"{self.tenant}.wake({list(self.stages or ())})"
        if self.op == RECEIVE:
            return f"{self.tenant}.receive({self.source})"
        return f"the rollback of {self.tenant} to {list(self.stages or ())} awake"


@dataclass(frozen=True)
class Plan:
    """The steps of one switch for one proc, in order, and how releases are judged."""

    steps: tuple[Step, ...]
    release_fraction: float = 0.9
    release_timeout_s: float = 10.0
    min_verified_bytes: int = 1 << 20
    deadline: float | None = None  # time.monotonic() after which no step starts
    id: int = 0
    backup_dir: str | None = None  # where backups to disk go (None: memory's default)


@dataclass
class Failure:
    """Where and why a plan stopped. kind: "raised" (the tenant's call raised),
    "release" (the memory did not come back), "timeout" (no answer in time), "lost" (the
    proc died)."""

    index: int
    label: str
    kind: str
    cause: str
    drop: int = 0  # release: the bytes seen to leave
    expected: int = 0  # release: the bytes the tenant said it held
    error: BaseException | None = field(default=None, compare=False, repr=False)


@dataclass
class PlanResult:
    """A plan's one answer."""

    done: int = 0  # steps completed
    copied: int = 0  # bytes copied by receive steps
    moved: Traffic = Traffic()  # what its sleeps and wakes moved to and from host memory
    infos: dict[str, TenantInfo] = field(default_factory=dict)  # restore: each tenant's account
    unknown: list[str] = field(default_factory=list)  # restore: tenants that could not say
    failure: Failure | None = None
    # pid -> what its backups held (`memory.backup_reading`), read as the plan ended
    backups: dict[int, BackupReading] = field(default_factory=dict)


@dataclass
class PlanClock:
    """The plans `run_here` carried out in this process and the seconds they took: what
    switches cost inside the proc, apart from the messages that bring and answer them."""

    plans: int = 0
    seconds: float = 0.0


clock = PlanClock()


@dataclass(frozen=True)
class Call:
    tenant: str
    method: str  # sleep, wake, receive, describe
    args: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Read:
    tenant: str
    device: str


@dataclass(frozen=True)
class Wait:
    seconds: float


@dataclass(frozen=True)
class At:
    plan: int
    index: int
    phase: str  # "call", or "release" while the release is measured


Op = Call | Read | Wait | At


class NotReleased(Exception):
    """A sleep's memory did not come back within the release timeout."""

    def __init__(self, drop: int, expected: int, timeout_s: float) -> None:
        super().__init__(f"only {drop / 2**20:.1f} of its {expected / 2**20:.1f} MiB came "
                         f"back within {timeout_s} s (memory held outside its tags?)")
        self.drop, self.expected = drop, expected


def execute(plan: Plan) -> Generator[Op, Any, PlanResult]:
    """Carry out `plan`'s steps in order; stop at the first that fails (see module)."""
    result = PlanResult()
    for index, step in enumerate(plan.steps):
        if plan.deadline is not None and time.monotonic() > plan.deadline:
            result.failure = Failure(index, step.label(), "timeout",
                                     "the arbiter had stopped waiting before it began")
            break
        yield At(plan.id, index, "call")
        try:
            if step.op == SLEEP:
                yield from _sleep(plan, index, step)
            elif step.op == WAKE:
                yield Call(step.tenant, WAKE, (list(step.stages or ()),))
            elif step.op == RECEIVE:
                result.copied += yield Call(step.tenant, RECEIVE, (step.source,))
            elif step.op == RESTORE:
                result.infos[step.tenant] = yield from _restore(step)
            else:
                raise ValueError(f"unknown plan step {step.op!r}")
        except NotReleased as err:
            result.failure = Failure(index, step.label("release"), "release", str(err),
                                     err.drop, err.expected, err)
            break
        except Exception as err:
            result.failure = Failure(index, step.label(), "raised", _text(err), error=err)
            break
        result.done = index + 1
    if result.failure is not None and all(s.op == RESTORE for s in plan.steps):
        # a rollback that failed: say what every tenant it did not restore holds now
        for step in plan.steps[result.failure.index:]:
            try:
                result.infos[step.tenant] = yield Call(step.tenant, "describe")
            except Exception:
                result.unknown.append(step.tenant)
    return result


def _sleep(plan: Plan, index: int, step: Step) -> Generator[Op, Any, None]:
    before = (yield Read(step.tenant, step.device)) if step.verify else 0
    stages = None if step.stages is None else list(step.stages)
    # places only when one is not the default (host): tenants of before them take no places
    expected = yield Call(step.tenant, SLEEP,
                          (stages, dict(step.places)) if step.places else (stages,))
    if not step.verify or expected < plan.min_verified_bytes:
        return
    yield At(plan.id, index, "release")
    give_up = time.monotonic() + plan.release_timeout_s
    while True:
        drop = before - (yield Read(step.tenant, step.device))
        if drop >= plan.release_fraction * expected:
            return
        if time.monotonic() > give_up:
            raise NotReleased(drop, expected, plan.release_timeout_s)
        yield Wait(RELEASE_POLL_S)


def _restore(step: Step) -> Generator[Op, Any, TenantInfo]:
    info: TenantInfo = yield Call(step.tenant, "describe")
    keep = tuple(step.stages or ())
    extra = [s for s in info.awake_stages if s not in keep]
    if extra:
        yield Call(step.tenant, SLEEP, (list(extra) if keep else None,))
    awake = [s for s in info.awake_stages if s in keep]
    missing = [s for s in keep if s not in awake]
    if missing:
        yield Call(step.tenant, WAKE, (missing,))
    if extra or missing:
        info = yield Call(step.tenant, "describe")
    return info


def _text(err: BaseException) -> str:
    return str(err) or type(err).__name__


# -- the driver in the tenants' process ------------------------------------------------


def run_here(plan: Plan, find: Callable[[str], Any]) -> PlanResult:
    """Run `plan` in this process: `find(name)` gives the object whose `sleep`, `wake`,
    `receive` and `describe` are tenant `name`'s own (they wait for its calls in flight).
    The answer carries errors as text (their classes may not load where it goes)."""
    began, moved = time.perf_counter(), memory.traffic()
    memory.set_backup_dir(plan.backup_dir)
    steps = execute(plan)
    answer: Any = None
    thrown: BaseException | None = None
    while True:
        try:
            op = steps.throw(thrown) if thrown is not None else steps.send(answer)
        except StopIteration as stop:
            result: PlanResult = stop.value
            break
        answer, thrown = None, None
        try:
            if isinstance(op, Call):
                answer = getattr(find(op.tenant), op.method)(*op.args)
            elif isinstance(op, Read):
                answer = used_here(op.device)
            elif isinstance(op, Wait):
                time.sleep(op.seconds)
            else:
                _board.mark(op)
        except Exception as err:
            thrown = err
    if result.failure is not None:
        result.failure.error = None
    result.moved = memory.traffic().since(moved)
    result.backups = {os.getpid(): memory.backup_reading(reset_peak=True)}
    clock.plans += 1
    clock.seconds += time.perf_counter() - began
    return result


def used_here(device: str) -> int:
    """This process's memory: its RSS (CPU), or its share of GPU `device` (NVML)."""
    if device == "cpu":
        return telemetry.process_rss()
    return telemetry.read_gpu_uuid_process(device, os.getpid()).used_bytes


# -- progress, readable after the proc died --------------------------------------------

_WIDTH = 48


class _Board:
    """This process's progress file: one line, rewritten in place at each step."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.pid = -1

    def mark(self, at: At) -> None:
        try:
            if self.fd is None or self.pid != os.getpid():
                self.pid = os.getpid()
                self.fd = os.open(progress_path(self.pid), os.O_CREAT | os.O_WRONLY, 0o600)
                atexit.register(forget_progress, self.pid)
            line = f"{at.plan} {at.index} {at.phase}".ljust(_WIDTH)[:_WIDTH]
            os.pwrite(self.fd, line.encode(), 0)
        except OSError:
            pass  # progress only sharpens an error message; the plan goes on without it


_board = _Board()


def read_progress(pid: int, plan_id: int) -> tuple[int, str] | None:
    """(step index, phase) that plan `plan_id` reached in process `pid`; None when it did
    not start a step (or left no file)."""
    try:
        with open(progress_path(pid)) as file:
            words = file.read().split()
        if len(words) == 3 and int(words[0]) == plan_id:
            return int(words[1]), words[2]
    except (OSError, ValueError):
        pass
    return None
