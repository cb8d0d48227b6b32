"""Fault tracking: the actor meshes a runtime spawned, by name, and which of them died.

Monarch reports a failed mesh (a proc died, an actor crashed) to the client's unhandled-
fault hook with the mesh's full name (`MeshFailure.mesh_name`: the spawn's name and an id
Monarch adds). Each spawn records that full name with its own name (`track`), so a fault
is mapped back to its spawn through that record, never by parsing the name; faults of
meshes nobody tracks (probes, meshes already forgotten) are ignored. An arbiter that finds
a tenant's proc dead during a switch (`TenantLostError`) reports it here too (`lost`), often
seconds before Monarch does, and so does the always-on watch of the procs' pids (`died`:
each spawn records the (host, pid)s of its procs, `watched` gives them per host).
Listeners (services) hear of each spawn that failed, once.
"""

from __future__ import annotations

import logging
from typing import Any

from colocate.arbiter.errors import ArbiterError
from colocate.resources.listener import Listener

logger = logging.getLogger(__name__)

UNCLAIMED_KEPT = 64  # faults of meshes not tracked (yet), kept for a spawn still recording


class Faults:
    """Which spawned actor meshes exist (by spawn name) and which of them failed."""

    def __init__(self) -> None:
        self.listeners: list[Listener] = []  # failed
        self._names: dict[str, str | None] = {}  # spawn name -> Monarch's full mesh name
        self._meshes: dict[str, str] = {}  # Monarch's full mesh name -> spawn name
        self._failed: dict[str, str] = {}  # spawn name -> why
        self._unclaimed: dict[str, str] = {}  # full mesh name -> why, not tracked when seen
        self._procs: dict[str, tuple[tuple[int, int], ...]] = {}  # spawn name -> (host, pid)s

    def reserve(self, name: str) -> None:
        """Take `name` for a spawn; names are unique among the meshes tracked."""
        if name in self._names:
            raise ArbiterError(f"actors named {name!r} already exist; names are unique: "
                               "remove them first, or choose another name")
        self._names[name] = None

    def track(self, name: str, mesh: str, procs: tuple[tuple[int, int], ...] = ()) -> None:
        """Record that spawn `name` is the mesh Monarch calls `mesh`, on the processes
        `procs` ((host, pid)s). A fault of that mesh seen before this record counts now."""
        self._names[name] = mesh
        self._procs[name] = procs
        self._meshes[mesh] = name
        if mesh in self._unclaimed:
            self._fail(name, self._unclaimed.pop(mesh))

    def forget(self, name: str) -> None:
        """Drop spawn `name` (its actors were stopped or undone): its name is free again and
        its mesh's later faults are ignored."""
        mesh = self._names.pop(name, None)
        if mesh is not None:
            self._meshes.pop(mesh, None)
        self._failed.pop(name, None)
        self._procs.pop(name, None)

    def watched(self) -> dict[int, set[int]]:
        """host -> the pids of the processes that run spawns not failed yet."""
        found: dict[int, set[int]] = {}
        for name, procs in self._procs.items():
            if name not in self._failed:
                for host, pid in procs:
                    found.setdefault(host, set()).add(pid)
        return found

    def on_procs(self, procs: set[tuple[int, int]]) -> list[str]:
        """The spawns with a process among `procs` ((host, pid)s)."""
        return [name for name, own in self._procs.items() if procs.intersection(own)]

    def died(self, host: int, pids: list[int], why: str) -> None:
        """Processes `pids` of `host` stopped running: every spawn on one of them failed."""
        for name in self.on_procs({(host, pid) for pid in pids}):
            self._fail(name, why.format(pid=next(p for h, p in self._procs[name]
                                                 if h == host and p in pids)))

    def known(self, name: str) -> bool:
        """Whether `name` is a spawn tracked here (alive or failed)."""
        return name in self._names

    def has_failed(self, name: str) -> bool:
        return name in self._failed

    def why(self, name: str) -> str | None:
        """Why spawn `name` failed (None while it has not)."""
        return self._failed.get(name)

    def alive(self, name: str) -> bool:
        """Tracked here and not failed."""
        return name in self._names and name not in self._failed

    def lost(self, names: tuple[str, ...] | list[str], why: str) -> None:
        """Mark spawns failed that an arbiter found dead (their proc died), ahead of
        Monarch's own report; names not tracked here are ignored."""
        for name in names:
            if name in self._names:
                self._fail(name, why)

    def on_fault(self, failure: Any) -> None:
        """Monarch's unhandled-fault hook: a mesh failed. Its spawn is marked failed and the
        listeners are told; the fault counts as handled, so the client goes on. Runs on
        Monarch's thread."""
        mesh = getattr(failure, "mesh_name", "")
        why = str(failure)
        logger.warning("mesh failure: %s", why.splitlines()[0] if why else mesh)
        name = self._meshes.get(mesh)
        if name is None:
            self._unclaimed[mesh] = why
            while len(self._unclaimed) > UNCLAIMED_KEPT:
                del self._unclaimed[next(iter(self._unclaimed))]
            return
        self._fail(name, why)

    def _fail(self, name: str, why: str) -> None:
        if name in self._failed:
            return
        self._failed[name] = why
        for listener in list(self.listeners):
            listener.failed(name, why)
