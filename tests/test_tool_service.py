"""The tools in a service of their own, on real Monarch procs without GPUs: every way a call
can go wrong ends as an error observation, counted, never as an exception, and within the
client's bound; a worker killed under a call is replaced by a retry on the other worker,
and a call that kills every worker it reaches ends as a "lost" observation."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from colocate.testing import MemoryTenant, start_runtime
from examples.rl_loop.tools import ToolClient, ToolsConfig
from services import ServiceConfig, ServiceConfigError, spawn_service
from services.replica import ReplicaState

pytestmark = pytest.mark.timeout(300)

TOOLS = '''
import asyncio, os, signal, time

def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b

def fails(x: int) -> str:
    """Raise.

    Args:
        x: anything
    """
    raise ValueError("no such thing")

def sleeps(seconds: float) -> str:
    """Sleep on this thread.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "slept"

async def naps(seconds: float) -> str:
    """Sleep in the event loop.

    Args:
        seconds: how long
    """
    await asyncio.sleep(seconds)
    return "napped"

def opaque(x: int) -> str:
    """Return something that is not text.

    Args:
        x: anything
    """
    return object()

async def blocks(seconds: float) -> str:
    """Block the worker's event loop (a bug: time.sleep in an async tool).

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "blocked"

def dies(x: int) -> str:
    """Kill this proc.

    Args:
        x: anything
    """
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
    return "never"
'''
NAMES = ("add", "fails", "sleeps", "naps", "opaque", "blocks", "dies")


@pytest.fixture
def specs(tmp_path: Path) -> list[str]:
    path = tmp_path / "service_tools.py"
    path.write_text(TOOLS)
    return [f"{path}:{name}" for name in NAMES]


async def test_tool_calls_end_as_results_or_counted_error_observations(specs):
    """One runtime for both parts: its start is most of the test's time."""
    async with start_runtime(gpus_per_host=1):
        tools = await ToolClient.spawn(ToolsConfig(funcs=specs, timeout_s=0.5, workers=2),
                                       grace_s=3.0)  # short, for the hung case
        assert tools.names == list(NAMES)
        assert await tools.service.schemas.route() == tools.schemas  # loaded in the proc too
        await errors_are_observations(tools)
        await killed_workers_cost_a_retry_or_an_observation(tools)
        await spawn_service(ServiceConfig(resource_group="gpu"), MemoryTenant, 1, name="slot")
        with pytest.raises(ServiceConfigError, match="resource group 'gpu' has GPUs"):
            await ToolClient.spawn(ToolsConfig(funcs=specs), resource_group="gpu")
        await tools.shutdown()


async def errors_are_observations(tools: ToolClient) -> None:
    start = time.monotonic()
    got = await asyncio.gather(tools.call("add", {"a": 2, "b": 40}),
                               tools.call("add", '{"a": 1, "b": 1}'),
                               tools.call("fails", {"x": 1}),
                               tools.call("sleeps", {"seconds": 30}),
                               tools.call("naps", {"seconds": 30}),
                               tools.call("opaque", {"x": 1}),
                               tools.call("nope", {}),
                               tools.call("add", {"a": 1}))
    assert time.monotonic() - start < 10  # each call within its limit, 0.5 s
    assert [r.content for r in got[:2]] == ["42", "2"]
    assert [r.error for r in got] == [None, None, "raised", "timeout", "timeout",
                                      "not_text", "unknown_tool", "bad_arguments"]
    assert "ValueError: no such thing" in got[2].content
    assert "did not answer within 0.5 s" in got[3].content
    assert sum(await tools.service.stuck.fanout()) == 1  # the sync sleeper's thread
    again = await tools.call("add", {"a": 1, "b": 2})  # its worker goes on
    assert (again.content, again.error) == ("3", None)
    stats = tools.take_stats().metrics()
    assert stats["tools/calls"] == 9 and stats["tools/errors"] == 6
    assert (stats["tools/errors/timeout"], stats["tools/errors/raised"]) == (2, 1)
    assert tools.take_stats().calls == 0


async def killed_workers_cost_a_retry_or_an_observation(tools: ToolClient) -> None:
    pids = {r.index: await r.actors.pid.call_one() for r in tools.service.replicas}
    call = asyncio.create_task(tools.call("naps", {"seconds": 0.4}))
    while not any(r.in_flight for r in tools.service.replicas):
        await asyncio.sleep(0.005)
    victim = next(r for r in tools.service.replicas if r.in_flight)
    os.kill(pids[victim.index], signal.SIGKILL)
    result = await asyncio.wait_for(call, tools.bound_s)
    assert (result.content, result.error) == ("napped", None)  # retried on the other
    assert victim.failed == 1  # the call it lost, counted on it
    start = time.monotonic()
    lost = await tools.call("dies", {"x": 0})  # kills each worker it reaches
    assert lost.error == "lost" and "was lost" in lost.content
    assert time.monotonic() - start < tools.bound_s
    assert tools.stats.errors["lost"] == 1
    await all_back(tools)
    start = time.monotonic()
    generations = [r.generation for r in tools.service.replicas]
    hung = await tools.call("blocks", {"seconds": 60})  # no answer: each worker killed
    assert (hung.error, hung.content) == ("lost", "error: blocks was lost: the worker "
                                          "calling it died or hung, and so did the retry's")
    assert time.monotonic() - start < tools.bound_s
    await all_back(tools)
    # each found hung by the service (call_timeout_s), killed and respawned
    assert [r.generation for r in tools.service.replicas] == [g + 1 for g in generations]
    assert (await tools.call("add", {"a": 1, "b": 1})).content == "2"


async def all_back(tools: ToolClient) -> None:
    for _ in range(300):  # the workers come back by themselves
        if all(r.state is ReplicaState.HEALTHY for r in tools.service.replicas):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(tools.service.failures())
