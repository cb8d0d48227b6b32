"""Hosts a runtime lost: seen by the proc watch, named for people, refused for new procs.

Each host's arbiter runs on that host; the client long-polls it all the time (`ProcWatchClient`).
When the host's worker dies (its Slurm task killed, its node set down, its machine gone),
the arbiter's process goes with it and the poll fails at once: that host is lost. Every
spawn with a proc there fails with the host named (`host 1 (Slurm job 41005, node c41n2)`,
with Slurm's view of the node when it is not up), so calls in flight end at once instead
of waiting for Monarch's supervision, and a group restart on a lost host fails fast
(`check`) rather than spawning procs on it; `listeners` hear of each lost host (a direct
call to a dead proc may wait long for Monarch's supervision: a run abandons its step).
Replacing a lost host is the client's: a new allocation (a run restarted there from its
checkpoint), its nodes in `nodes()` to leave out.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from colocate.resources.faults import Faults
from colocate.resources.host_job import HostJob
from colocate.resources.packing import ResourceError

logger = logging.getLogger(__name__)
UP = ("idle", "mixed", "allocated", "completing")  # sinfo's states of a node that runs jobs


class HostLostError(ResourceError):
    """A host of the runtime was lost: procs cannot be placed there any more."""


@dataclass(frozen=True)
class LostHost:
    host: int
    name: str  # `host 1 (Slurm job 41005, node c41n2)`
    node: str | None  # the Slurm node, when the hosts came from Slurm
    why: str
    detected_at: float  # time.time()


class LostHosts:
    """The runtime's lost hosts, in the order they were seen."""

    def __init__(self, job: HostJob, faults: Faults) -> None:
        self.job, self.faults = job, faults
        self.lost: dict[int, LostHost] = {}
        self.listeners: list[Callable[[LostHost], None]] = []  # told of each, on the loop

    def name(self, host: int) -> str:
        """`host 1 (Slurm job 41005, node c41n2)`; `host 1 (processes)` elsewhere."""
        job = self.job
        node = self.node(host)
        if job.scheduler == "slurm" and job.handle:
            return f"host {host} (Slurm job {job.handle}, node {node})"
        return f"host {host} ({job.scheduler}{', ' + job.handle if job.handle else ''})"

    def node(self, host: int) -> str | None:
        return self.job.nodes[host] if host < len(self.job.nodes) else None

    def add(self, host: int, why: str) -> None:
        """`host`'s arbiter stopped answering. Monarch fails a mesh whole, so the arbiters
        of the other hosts may go with it: where the job can tell whose worker is gone
        (`HostJob.answers`), those hosts are recorded first, then `host`. Every spawn with
        a proc on a lost host fails."""
        if host in self.lost:
            return
        gone = [h for h in range(self.job.num_hosts)
                if h not in self.lost and h != host and self.job.answers(h) is False]
        states = {h: self._state(h) for h in [*gone, host]}  # a node set down goes first
        for lost in sorted(states, key=lambda h: states[h] == ""):
            self._add(lost, why if lost == host else "its worker does not take connections",
                      states[lost])

    def _state(self, host: int) -> str:
        """Slurm's state of the host's node when it is not up (`down*`...), else ""."""
        node = self.node(host)
        state = _node_state(node) if self.job.scheduler == "slurm" and node else ""
        return state if state and state.split()[0].rstrip("*~#!%$@^-") not in UP else ""

    def _add(self, host: int, why: str, state: str) -> None:
        name = self.name(host) + (f", Slurm says the node is {state}" if state else "")
        found = LostHost(host, name, self.node(host), why, time.time())
        self.lost[host] = found
        logger.warning("lost %s: %s", name, why)
        procs = {(host, pid) for pid in self.faults.watched().get(host, ())}
        self.faults.lost(self.faults.on_procs(procs), f"{name} was lost ({why})")
        for listener in list(self.listeners):
            listener(found)

    def nodes(self) -> list[str]:
        """The Slurm nodes of the lost hosts."""
        return [h.node for h in self.lost.values() if h.node]

    def check(self, hosts: Iterable[int], what: str) -> None:
        """Raise HostLostError when one of `hosts` is lost (procs cannot start there)."""
        gone = [self.lost[h] for h in hosts if h in self.lost]
        if gone:
            raise HostLostError(f"{what}: {', '.join(h.name for h in gone)} lost "
                                f"({gone[0].why}); the run needs a new allocation")


def _node_state(node: str) -> str:
    """Slurm's state of `node` and its reason (`down (Not responding)`), "" without sinfo."""
    if shutil.which("sinfo") is None:
        return ""
    try:
        done = subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T|%E"],
                              capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = done.stdout.strip().splitlines()
    if not lines:
        return ""
    state, _, reason = lines[0].partition("|")
    return state + (f" ({reason.strip()})" if reason.strip() not in ("", "none") else "")
