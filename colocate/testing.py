"""Run the colocation runtime in your own tests: fixtures and tenants with known contents.

In a conftest.py (or a test module): ``pytest_plugins = ["colocate.testing"]``, then

    async def test_switch(colocate_runtime):
        alloc = await colocate_runtime.allocate(ResourceRequest("rl", 1, 2), owner="a")
        ...

`colocate_runtime` starts the runtime on this machine (its GPUs, or 2 virtual slots
without GPUs) and shuts it down after the test. `start_runtime(...)` does the same for
other shapes (`scheduler="processes", hosts=2`...). An `async def` test that asks for one
of these fixtures runs on asyncio as it is: no `asyncio_mode` setting or
`@pytest.mark.asyncio` needed (other async tests are left to the project's own set-up).
"""

from __future__ import annotations

import hashlib
import inspect
import os
import time
from collections.abc import AsyncIterator, Generator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import pytest_asyncio
import torch
from monarch.actor import endpoint

from colocate.arbiter.actor import TenantActor
from colocate.calls import needs
from colocate.resources.gpus import gpus_per_host
from colocate.resources.manager import ResourceManager
from colocate.resources.start import init


@asynccontextmanager
async def start_runtime(scheduler: Any = "local", hosts: int = 1,
                        gpus_per_host: int | None = None, **options: Any
                        ) -> AsyncIterator[ResourceManager]:
    """The runtime for one block: started, yielded, shut down (also on failure)."""
    rm = await init(scheduler, hosts, gpus_per_host or _default_slots(), **options)
    try:
        yield rm
    finally:
        await rm.shutdown()


def _default_slots() -> int:
    return min(gpus_per_host(), 8) or 2


FIXTURES = ("colocate_runtime", "slot_device")  # what marks an async test as ours


@pytest.hookimpl(wrapper=True)
def pytest_pycollect_makeitem(collector: Any, name: str, obj: object) -> Generator[Any, Any, Any]:
    """Mark an `async def` test that asks for a fixture of this plugin `asyncio`, before
    pytest-asyncio looks at it: in its default (strict) mode it runs only marked tests."""
    if inspect.iscoroutinefunction(obj) and _asks_for_ours(obj) and not any(
            mark.name == "asyncio" for mark in getattr(obj, "pytestmark", ())):
        pytest.mark.asyncio(obj)
    return (yield)


def _asks_for_ours(function: Any) -> bool:
    try:
        return any(name in FIXTURES for name in inspect.signature(function).parameters)
    except (TypeError, ValueError):  # no signature to read
        return False


@pytest_asyncio.fixture
async def colocate_runtime() -> AsyncIterator[ResourceManager]:
    async with start_runtime() as rm:
        yield rm


@pytest.fixture
def slot_device() -> str:
    """Where test tenants allocate: "cuda" on GPU slots, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


class MemoryTenant(TenantActor):
    """A tenant holding `mib` MiB of seeded random weights (kept across sleeps) and `mib`
    MiB of cache (discarded), so a test can check contents and measure release."""

    stages = {"weights": True, "cache": False}

    def __init__(self, mib: int, seed: int = 0) -> None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        generator = torch.Generator(device=device).manual_seed(seed)
        with self.tenancy.region("weights", device=device):
            self.weights = torch.randint(0, 2**31, (mib << 18,), dtype=torch.int32,
                                         device=device, generator=generator)
        with self.tenancy.region("cache", device=device):
            self.cache = torch.zeros(mib << 18, device=device)
        self.served = {"awake": 0, "asleep": 0}
        self.asleep_at: list[float] = []  # when calls reached it asleep: for diagnosis

    @endpoint
    def checksum(self) -> str:
        """The weights' SHA-256; raises TagPausedError while asleep."""
        self.tenancy.ensure_awake()
        return hashlib.sha256(self.weights.cpu().view(torch.uint8).numpy().tobytes()).hexdigest()

    @endpoint
    def use_cache(self, value: float) -> float:
        self.tenancy.ensure_awake()
        self.cache.fill_(value)
        return float(self.cache[-1])

    @endpoint
    def work(self, x: int, seconds: float = 0.0) -> int:
        """Serve a request (taking `seconds`): counted, and counted apart when it reached
        this tenant asleep (a router that respects the arbiter never lets that happen)."""
        time.sleep(seconds)
        asleep = self.tenancy.awake_stages() != tuple(self.stages)
        self.served["asleep" if asleep else "awake"] += 1
        if asleep:
            self.asleep_at.append(time.time())
        if not asleep:
            self.cache[0] = x
        return x

    @endpoint
    def counts(self) -> dict[str, Any]:
        return {**self.served, "asleep_at": self.asleep_at}

    @endpoint
    def memory(self) -> dict[str, int]:
        """What the proc holds: its RSS (CPU) or the device's used bytes (GPU)."""
        from colocate import telemetry

        if torch.cuda.is_available():
            torch.cuda.synchronize()
            return {"pid": os.getpid(), "used": telemetry.read_gpu(0).used_bytes}
        return {"pid": os.getpid(), "used": telemetry.process_rss()}


class DeclaredTenant(MemoryTenant):
    """A `MemoryTenant` whose endpoints `read` and `fill` declare the stages they need
    (`colocate.needs`), so a service routes them while its other stage sleeps; its other
    endpoints need every stage."""

    @endpoint
    @needs("weights")
    def read(self) -> list[str]:
        """Its awake stages; raises TagPausedError while its weights sleep."""
        self.tenancy.ensure_stage("weights")
        return list(self.tenancy.awake_stages())

    @endpoint
    @needs("cache")
    def fill(self, value: float) -> list[str]:
        """Fill the cache with `value`; its awake stages. Raises TagPausedError while its
        cache sleeps."""
        self.tenancy.ensure_stage("cache")
        self.cache.fill_(value)
        return list(self.tenancy.awake_stages())


class FailingSleepTenant(MemoryTenant):
    """A `MemoryTenant` whose sleeps raise after the first `healthy_sleeps`, for testing how
    failures are reported."""

    def __init__(self, mib: int, seed: int = 0, healthy_sleeps: int = 1) -> None:
        super().__init__(mib, seed)
        self.healthy_sleeps = healthy_sleeps

    @endpoint
    def sleep(self, stages: list[str] | None = None,
              places: dict[str, str] | None = None) -> int:
        if self.healthy_sleeps <= 0:
            raise RuntimeError("injected sleep failure")
        self.healthy_sleeps -= 1
        return self.tenancy.sleep(stages, places)


class ScratchTenant(MemoryTenant):
    """A `MemoryTenant` whose `scratch(mib)` works in `mib` MiB of tagged memory it never
    declared (its "scratch" stage, dropped at a sleep): a call that may need more than its
    slot has free."""

    stages = {"weights": True, "cache": False, "scratch": False}

    @endpoint
    def scratch(self, mib: int) -> float:
        """Fill `mib` MiB of scratch with ones, let it go, and return its sum."""
        device = "cuda" if torch.cuda.is_available() else "cpu"
        with self.tenancy.region("scratch", device=device):
            work = torch.ones(mib << 18, device=device)
        return float(work.sum())
