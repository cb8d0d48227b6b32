"""A test tenant that fails on demand at any step of a switch, a handoff or a weight sync.

`FaultyTenant` holds seeded weights (kept across a sleep) and a cache (discarded). Its
`sleep`, `wake` and `receive` run stage by stage and bucket by bucket, and before each
step they look at the fault plan that `arm(step, fault, slot)` set (one shot: the fault
fires once, then the plan is empty). The steps:

    sleep:<stage>    before the stage is paused (caches pause first)
    release:<stage>  a sleep that paused <stage> holds a ballast of the bytes it released,
                     so the arbiter's release check sees nothing come back
    wake:<stage>     before the stage is resumed (in wake order)
    receive:<k>      before bucket k of the copy from the source tenant

and the faults:

    raise  the endpoint raises `InjectedFault` (for release: the ballast stays, so the
           memory never comes back)
    kill   SIGKILL of the tenant's proc (for release: while the arbiter measures)
    hang   the step blocks `hang_s` seconds, then goes on (for release: the ballast goes
           after `hang_s`, past the arbiter's release timeout)

The procs import this module by name: the test puts tests/ on their PYTHONPATH.
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from typing import Any

import torch
from monarch.actor import endpoint

from colocate.arbiter.actor import TenantActor
from colocate.resources.procs import SLOT_ENV
from colocate.telemetry import process_rss

FAULTS = ("raise", "kill", "hang")
_LIVE: dict[str, FaultyTenant] = {}  # tenant name -> the tenant, in this process


class InjectedFault(RuntimeError):
    """The fault a test asked for."""


class FaultyTenant(TenantActor):
    """Weights (`weights_mib`, seeded per slot) and a cache (`cache_mib`); `receive` copies
    a same-process tenant's weights in `buckets` buckets."""

    stages = {"weights": True, "cache": False}

    def __init__(self, weights_mib: int, cache_mib: int, seed: int, buckets: int = 2) -> None:
        self.slot = int(os.environ[SLOT_ENV])
        with self.tenancy.region("weights", device="cpu"):
            self.weights = torch.empty(weights_mib << 18, dtype=torch.int32)
        self._fill(seed)
        with self.tenancy.region("cache", device="cpu"):
            self.cache = torch.ones(cache_mib << 18)
        self.buckets = buckets
        self.plan: tuple[str, str, float] | None = None  # (step, fault, hang_s)
        self.ballast: torch.Tensor | None = None
        self.ballasts = 0  # how many were held so far: a late drop is of its own only
        self.lock = threading.Lock()
        self.served = {"awake": 0, "asleep": 0}
        _LIVE[self.tenant_name] = self

    # -- the plan --------------------------------------------------------------------

    @endpoint
    def arm(self, step: str, fault: str, slot: int, hang_s: float = 0.0) -> None:
        """Fail at `step` with `fault`, once, on the proc of `slot` (others ignore it)."""
        if fault not in FAULTS:
            raise ValueError(f"fault={fault!r}: use one of {FAULTS}")
        if slot == self.slot:
            self.plan = (step, fault, hang_s)

    def _fault(self, step: str) -> None:
        if self.plan is None or self.plan[0] != step:
            return
        _, fault, hang_s = self.plan
        self.plan = None
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # the signal lands before this returns
        if fault == "hang":
            time.sleep(hang_s)
            return
        raise InjectedFault(f"injected fault at {step} in {self.tenant_name} on slot "
                            f"{self.slot}")

    # -- the tenant protocol, step by step --------------------------------------------

    @endpoint
    def sleep(self, stages: list[str] | None = None) -> int:
        self._drop_ballast()
        awake = self.tenancy.awake_stages()
        released, paused = 0, []
        for stage in reversed(self.tenancy.stages):  # caches first
            if stage in awake and (stages is None or stage in stages):
                self._fault(f"sleep:{stage}")
                released += self.tenancy.sleep([stage])
                paused.append(stage)
        if self.plan and self.plan[0] in {f"release:{p}" for p in paused}:
            self._hold_back(released)
        return released

    def _hold_back(self, nbytes: int) -> None:
        """The release fault: hold `nbytes` outside the tags (the arbiter sees no drop),
        then keep them (raise), die (kill) or let them go late (hang)."""
        assert self.plan is not None
        _, fault, hang_s = self.plan
        self.plan = None
        with self.lock:
            self.ballast = torch.ones(nbytes // 4, dtype=torch.int32)
            self.ballasts += 1
        if fault == "kill":
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGKILL)).start()
        elif fault == "hang":  # this ballast only: a later row's may be held by then
            threading.Timer(hang_s, self._drop_ballast, (self.ballasts,)).start()

    def _drop_ballast(self, only: int | None = None) -> None:
        """Drop the ballast held (with `only`: if it is still the `only`-th one held)."""
        with self.lock:
            if only is None or self.ballasts == only:
                self.ballast = None

    @endpoint
    def wake(self, stages: list[str]) -> None:
        self._drop_ballast()
        for stage in stages:
            self._fault(f"wake:{stage}")
            self.tenancy.wake([stage])

    @endpoint
    def receive(self, source: str) -> int:
        """Copy `source`'s weights into ours, a bucket at a time."""
        self.tenancy.ensure_stage("weights")
        theirs = _LIVE[source].weights
        copied = 0
        for k, (mine, other) in enumerate(zip(self.weights.chunk(self.buckets),
                                              theirs.chunk(self.buckets), strict=True)):
            self._fault(f"receive:{k}")
            mine.copy_(other)
            copied += mine.numel() * mine.element_size()
        return copied

    @endpoint
    def scramble(self, seed: int) -> None:
        """New seeded weights, so that a copy into them shows (they must be awake)."""
        self.tenancy.ensure_stage("weights")
        self._fill(seed)

    def _fill(self, seed: int) -> None:
        """Seeded weights, per slot, written in place (no temporary copy, so the proc's
        RSS stays what its tags hold)."""
        generator = torch.Generator().manual_seed(seed * 1000 + self.slot)
        self.weights.random_(0, 2**31, generator=generator)

    # -- what a test reads ------------------------------------------------------------

    @endpoint
    def checksum(self) -> str:
        """SHA-256 of the weights (kept across sleeps); raises TagPausedError asleep."""
        self.tenancy.ensure_stage("weights")
        return hashlib.sha256(self.weights.numpy()).hexdigest()  # no copy

    @endpoint
    def held(self) -> dict[str, Any]:
        """This proc's pid, slot and RSS now."""
        return {"pid": os.getpid(), "slot": self.slot, "rss": process_rss()}

    @endpoint
    def work(self, x: int, seconds: float = 0.0) -> dict[str, Any]:
        """Serve request `x` (taking `seconds`) and say whether it reached this tenant
        asleep, which a router that follows the arbiter never lets happen (counted here
        too); request x < 0 raises InjectedFault, an endpoint error for its caller."""
        asleep = self.tenancy.awake_stages() != tuple(self.stages)
        self.served["asleep" if asleep else "awake"] += 1
        if x < 0:
            raise InjectedFault(f"request {x} refused by {self.tenant_name}")
        time.sleep(seconds)
        return {"x": x, "asleep": asleep, "tenant": self.tenant_name}

    @endpoint
    def counts(self) -> dict[str, int]:
        """Requests served awake and asleep by this tenant on this proc."""
        return dict(self.served)
