"""Checks around a spawn, so that an actor that cannot start fails alone, with one error.

Before the spawn, `check_importable` asks the procs to load the actor's class as Monarch
will send it: a class whose module the procs cannot import would otherwise fail inside
Monarch and leave the procs refusing every later spawn. After the spawn, `check_started`
asks a tenant, from the client, whether its `__init__` succeeded, before any arbiter talks
to it. Either failure raises `SpawnError`, naming the actor and carrying the original
exception's type and message; `stop_actors` stops what such a spawn made.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
from typing import Any

import cloudpickle
from monarch.actor import Actor, ActorError, endpoint

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
