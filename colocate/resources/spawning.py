"""Spawning actors on the runtime's procs, and their life until they are removed.

`Spawns` is the part of the resource manager that does it: a spawn is checked, tracked
(its mesh's faults, its procs in the always-on proc watch) and, for a tenant on
time-shared procs, registered with its hosts' arbiters, or undone whole; a removal undoes
all three. The checks around a spawn make an actor that cannot start fail alone, with one
error. Before the spawn, `check_importable` asks the procs to load the actor's class as
Monarch will send it: a class whose module the procs cannot import would otherwise fail
inside Monarch and leave the procs refusing every later spawn. After the spawn,
`check_started` asks a tenant, from the client, whether its `__init__` succeeded, before
any arbiter talks to it. Either failure raises `SpawnError`, naming the actor and carrying
the original exception's type and message; `stop_actors` stops what such a spawn made.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import cloudpickle
from monarch.actor import Actor, ActorError, endpoint

from colocate.arbiter.actor import Preempter, TenantActor
from colocate.arbiter.proc_watch import ProcWatchClient
from colocate.arbiter.tenant import TenantInfo
from colocate.calls import call_spec
from colocate.monarch_compat import endpoint_names, mesh_name
from colocate.resources.faults import Faults
from colocate.resources.groups import Allocation, Groups
from colocate.resources.procs import rank_of
from colocate.resources.switching import Switchboard

logger = logging.getLogger(__name__)


class SpawnError(RuntimeError):
    """An actor could not start: its procs cannot import its class, its `__init__` raised,
    or its process died while starting.

    `exception_type` and `exception_message` are the original exception's (both None when
    the process died: `cause` then says how); `exception` is the exception itself when it
    came back to the caller. `procs_lost` says whether the procs can take no new actor.
    """

    def __init__(self, message: str, name: str, cause: str,
                 exception_type: str | None = None, exception_message: str | None = None,
                 exception: BaseException | None = None, procs_lost: bool = False) -> None:
        super().__init__(message)
        self.name, self.cause, self.procs_lost = name, cause, procs_lost
        self.exception_type, self.exception_message = exception_type, exception_message
        self.exception = exception


class ImportProbe(Actor):
    """Loads a pickled class in a proc and says what failed, without failing itself."""

    @endpoint
    def load(self, pickled: bytes) -> str | None:
        try:
            cloudpickle.loads(pickled)
        except Exception as err:
            return f"{type(err).__name__}: {err}"
        return None


def _qualified(actor_class: type) -> str:
    return f"{actor_class.__module__}.{actor_class.__qualname__}"


def _module_root(module: str) -> str | None:
    """The directory to put on PYTHONPATH so that `module` imports, when it is known here."""
    found = sys.modules.get(module)
    path = getattr(found, "__file__", None)
    if not path:
        return None
    root = os.path.dirname(os.path.abspath(path))
    if os.path.basename(path).startswith("__init__."):
        root = os.path.dirname(root)
    for _ in range(module.count(".")):
        root = os.path.dirname(root)
    return root


async def check_importable(procs: Any, name: str, actor_class: type,
                           slots: list[tuple[int, int]], group: str) -> None:
    """Raise `SpawnError` unless every proc of `procs` can load `actor_class` (procs load
    a class by its module, unless it was defined in `__main__` or inside a function)."""
    pickled = cloudpickle.dumps(actor_class)
    try:
        probe = procs.spawn("import_probe", ImportProbe)
        found = await probe.load.call(pickled)
    except Exception as err:  # the procs take no actor at all
        cause, _, _ = _remote_cause(str(err))
        raise SpawnError(f"cannot spawn {name!r}: {cause}. " + _lost(slots, group), name,
                         cause, procs_lost=True) from err
    await probe.stop()
    failures = sorted({error for _, error in found.items() if error})
    if not failures:
        return
    module = actor_class.__module__
    root = _module_root(module)
    where = f" (here it is in {root})" if root else ""
    exception_type, _, exception_message = failures[0].partition(": ")
    raise SpawnError(
        f"cannot spawn {name!r}: the procs cannot load {_qualified(actor_class)} "
        f"({failures[0]}). This happened in the procs, which import a class by its module: "
        f"put the directory of module {module!r}{where} on the procs' PYTHONPATH (procs "
        "that colocate.init starts inherit the PYTHONPATH of the process that starts them, "
        "so set it before init), or install it as a package there.",
        name, failures[0], exception_type, exception_message)


def _remote_cause(text: str) -> tuple[str, str | None, str | None]:
    """(cause, exception type, exception message) from a Monarch supervision report: the
    last `Type: message` line of the remote traceback, or how the process ended."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if any("Traceback" in line for line in lines):
        match = re.match(r"^([A-Za-z_][\w.]*): ?(.*)$", lines[-1])
        if match:
            return lines[-1], match.group(1).rsplit(".", 1)[-1], match.group(2)
    for i, line in enumerate(lines):
        if line.endswith("have failed:") and i + 1 < len(lines):
            return lines[i + 1], None, None
    return (lines[0] if lines else repr(text)), None, None


async def check_started(actors: Any, name: str, actor_class: type,
                        slots: list[tuple[int, int]], group: str) -> None:
    """Raise `SpawnError` unless the tenant `actors` started on every proc: call its
    `started()` endpoint, which raises what its `__init__` raised."""
    try:
        await actors.started.call()
    except ActorError as err:  # __init__ raised: kept by TenantActor, the procs are fine
        original = err.exception
        cause = f"{type(original).__name__}: {original}"
        raise SpawnError(
            f"tenant {name!r} ({_qualified(actor_class)}) failed to start: {cause} (raised "
            "by its __init__, in its procs). Nothing of it is left: its actors were stopped "
            "and its allocation freed; the arbiters and the other tenants go on, and the "
            "name can be spawned again.",
            name, cause, type(original).__name__, str(original), original) from err
    except Exception as err:  # its process died, or Monarch failed the actor
        cause, exception_type, exception_message = _remote_cause(str(err))
        raise SpawnError(
            f"tenant {name!r} ({_qualified(actor_class)}) failed to start: {cause}. "
            + _lost(slots, group) + " The name can be spawned again.",
            name, cause, exception_type, exception_message, procs_lost=True) from err


def _lost(slots: list[tuple[int, int]], group: str) -> str:
    return (f"Its procs, (host, slot) {sorted(slots)}, take no new actor now (the process "
            "died, or Monarch refuses a proc where an actor failed): to use those slots "
            f"again, rm.release({group!r}) and allocate anew. The arbiters and the tenants "
            "of other procs go on.")


async def stop_actors(name: str, actors: Any, grace_s: float) -> None:
    """Stop the actors spawned as `name`; a stop that does not end within `grace_s` (its
    proc died unseen: Monarch waits 30 s on a dead proc) is logged and left behind."""
    try:
        await asyncio.wait_for(actors.stop(), grace_s)
    except Exception as err:
        logger.warning("the actors of %r did not stop within %s s (%s); left behind",
                       name, grace_s, str(err).splitlines()[0] if str(err) else
                       type(err).__name__)


class Spawns:
    """The actors spawned on the runtime's procs, from their spawn to their removal."""

    def __init__(self, groups: Groups, faults: Faults, switchboard: Switchboard) -> None:
        self.groups, self.faults, self.switchboard = groups, faults, switchboard
        self.proc_watch: ProcWatchClient | None = None  # started with the arbiters
        # name -> its actor mesh and procs per host, for usage()
        self._tenant_actors: dict[str, tuple[Any, int]] = {}

    def start_proc_watch(self, hosts: int, on_lost: Callable[[int, str], None],
                         answers: Callable[[int], bool | None]) -> None:
        """Have each of the `hosts`' arbiters watch the procs that run spawns from now on;
        a host found lost goes to `on_lost(host, why)`."""
        self.proc_watch = ProcWatchClient(self.switchboard.arbiter, hosts, self._procs_died,
                                          on_lost, answers)
        self.proc_watch.start()

    def _procs_died(self, host: int, pids: list[int]) -> None:
        """The proc watch of `host` found `pids` dead: their spawns failed."""
        self.faults.died(host, pids, "its proc, pid {pid}, died (found by the proc watch "
                                     f"of host {host})")

    async def spawn(self, name: str, actor_class: type[Actor], allocation: Allocation,
                    *args: Any, **kwargs: Any) -> Any:
        """Spawn `actor_class` on the allocation's procs. A `TenantActor` on time-shared procs
        is registered with its hosts' arbiters (and put to sleep where another tenant is
        awake); on procs of a group without GPUs it takes no slot and never sleeps.

        An actor that cannot start (its class does not import in the procs, a tenant's
        `__init__` raises, its process dies) raises one `SpawnError` naming it and the
        original exception; what the spawn made is undone (its actors stopped, the name
        free again, the allocation given back), and the arbiters and the other tenants go
        on. A tenant is asked from here whether it started before any arbiter calls it."""
        self.faults.reserve(name)
        try:
            await check_importable(allocation.procs, name, actor_class,
                                   list(allocation.slots), allocation.group)
        except BaseException:
            self.forget(name)
            self._give_back(allocation)
            raise
        actors = allocation.procs.spawn(name, actor_class, *args, **kwargs)
        preempters = None
        try:
            tenant = issubclass(actor_class, TenantActor)
            if tenant:  # it checks its own start, time-shared or not
                await check_started(actors, name, actor_class, list(allocation.slots),
                                    allocation.group)
            self.faults.track(name, await mesh_name(actors), allocation.host_pids())
            self.watch_procs()
            if tenant and allocation.timeshared:
                if _preemptible(actor_class):  # see colocate.arbiter.preempt
                    preempters = allocation.procs.spawn(f"{name}_preempt", Preempter)
                await self.switchboard.register(name, actors, allocation, preempters)
                self._tenant_actors[name] = (actors, allocation.procs_per_host)
        except BaseException:
            if preempters is not None:
                await stop_actors(f"{name}_preempt", preempters, 5.0)
            await self._undo_spawn(name, actors, allocation)
            raise
        return actors

    async def _undo_spawn(self, name: str, actors: Any, allocation: Allocation,
                          grace_s: float = 5.0) -> None:
        """Forget a spawn that failed: its tenancy, its name, its actors, its allocation.
        Faults its mesh reports later are ignored (its mesh is no longer tracked)."""
        self.forget(name)
        self.watch_procs()
        await stop_actors(name, actors, grace_s)
        self._give_back(allocation)

    def _give_back(self, allocation: Allocation) -> None:
        """`free` an allocation of the group's own procs; one on replacement procs stands
        for slots its owner still holds through its first allocation, so those stay."""
        if not allocation.replacement:
            self.groups.free(allocation)

    async def remove(self, name: str, actors: Any, grace_s: float = 5.0,
                     stop: bool = True) -> None:
        """Stop spawned actors (unless they died, or `stop` is False: their procs are about
        to be stopped) and forget them; their procs stay. A stop that does not end within
        `grace_s` (its proc died unseen) is left behind."""
        preempters = self.switchboard.preempters.actors.get(name)
        await self.switchboard.unregister(name)
        failed = self.faults.has_failed(name)
        self.forget(name)
        self.watch_procs()
        if stop and not failed:
            if preempters is not None:
                await stop_actors(f"{name}_preempt", preempters, grace_s)
            await stop_actors(name, actors, grace_s)

    async def lose(self, names: list[str], why: str) -> None:
        """Fail spawns `names` (their procs are going) and forget them, arbiters included."""
        self.faults.lost(names, why)
        for name in names:
            await self.switchboard.unregister(name)
            self.forget(name)
        self.watch_procs()

    def forget_on(self, slots: set[tuple[int, int]]) -> None:
        """Forget the spawns on `slots` (their procs were stopped)."""
        for name in self.switchboard.forget_slots(slots):
            self.forget(name)
        self.watch_procs()

    def forget(self, name: str) -> None:
        """Forget spawn `name` here, the one place that does: its tenancy in the view, its
        actors, its faults (the arbiters' side is `Switchboard.unregister`'s)."""
        self.switchboard.forget(name)
        self._tenant_actors.pop(name, None)
        self.faults.forget(name)

    def watch_procs(self) -> None:
        """Have the arbiters watch the procs that run spawns now."""
        if self.proc_watch is not None:
            self.proc_watch.watch(self.faults.watched())

    async def usage(self, timeout_s: float = 10.0
                    ) -> dict[int, dict[int, dict[str, TenantInfo | None]]]:
        """host -> slot -> tenant -> its `TenantInfo` now: `resident_bytes` (held now),
        `tagged_bytes` (held when fully awake), `awake_stages`, pid, device. Each tenant
        answers for itself on each of its procs, from here; a proc that died, or does not
        answer within `timeout_s`, reads None (the tenant's other procs still answer)."""

        async def ask(proc: Any) -> TenantInfo | None:
            try:
                return await asyncio.wait_for(proc.describe.call_one(), timeout_s)
            except Exception:
                return None

        view = self.switchboard.view
        asked = [(name, host, slot, ask(rank_of(actors, rank, per_host)))
                 for name, (actors, per_host) in self._tenant_actors.items()
                 if view.is_tenant(name)
                 for rank, (host, slot) in enumerate(view.slots_of(name))]
        answers = await asyncio.gather(*(question for *_, question in asked))
        usage: dict[int, dict[int, dict[str, TenantInfo | None]]] = {}
        for (name, host, slot, _), info in zip(asked, answers, strict=True):
            usage.setdefault(host, {}).setdefault(slot, {})[name] = info
        return usage


def _preemptible(actor_class: type) -> bool:
    """Whether any endpoint of `actor_class` is declared `@preemptible`."""
    return any(call_spec(actor_class, e).preemptible for e in endpoint_names(actor_class))
