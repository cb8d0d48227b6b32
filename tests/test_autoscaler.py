"""The autoscaler on its narrow interface (a load snapshot, add and remove), without a service;
and the import layering it keeps: services/autoscaler.py imports no service module."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

from services.autoscaler import Autoscaler, LoadSnapshot, ReplicaLoad
from services.config import ServiceConfig

ROOT = Path(__file__).resolve().parent.parent


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_the_autoscaler_and_the_service_do_not_import_each_other():
    assert not {m for m in imports_of(ROOT / "services/autoscaler.py")
                if m.startswith("services.") and m != "services.config"}
    assert "services.autoscaler" in imports_of(ROOT / "services/service.py")  # one way only


def test_it_scales_up_on_queue_depth_and_down_when_idle_through_its_callables():
    config = ServiceConfig(num_replicas=1, min_replicas=1, max_replicas=3,
                           scale_up_queue_depth=2, scale_cooldown_s=0.01,
                           scale_down_utilization=0.5)
    replicas = [ReplicaLoad(0, in_flight=5, busy_s=0.0, healthy=True)]
    waiting = 3
    removed: list[int] = []

    def load() -> LoadSnapshot:
        return LoadSnapshot(tuple(replicas), ready=sum(r.healthy for r in replicas),
                            waiting=waiting)

    async def add() -> None:
        replicas.append(ReplicaLoad(len(replicas), 0, 0.0, True))

    async def remove(index: int) -> None:
        removed.append(index)
        replicas[:] = [r for r in replicas if r.index != index]

    async def scenario() -> None:
        nonlocal waiting
        scaler = Autoscaler("gen", config, load, add, remove)
        scaler.last_change -= 1
        await scaler.step()  # 8 calls for 1 ready replica: depth 8 > 2
        assert len(replicas) == 2 and "queue depth 8.0 > 2" in scaler.history[-1][2]
        await asyncio.sleep(0.02)
        await scaler.step()  # 5 calls for 2: depth 2.5 > 2
        assert len(replicas) == 3
        await asyncio.sleep(0.02)
        await scaler.step()  # at max_replicas: no more
        assert len(replicas) == 3
        replicas[0] = ReplicaLoad(0, 0, 0.0, True)  # idle now, nothing waiting
        waiting = 0
        await asyncio.sleep(0.02)
        await scaler.step()
        assert removed == [2]  # the least loaded; ties go to the newest
        assert [count for _, count, _ in scaler.history] == [2, 3, 2]

    asyncio.run(scenario())


def test_a_busy_replica_holds_the_scale_down():
    config = ServiceConfig(num_replicas=2, min_replicas=1, max_replicas=2,
                           scale_cooldown_s=0.01, scale_down_utilization=0.5)
    busy = {0: 0.0, 1: 0.0}
    removed: list[int] = []

    def load() -> LoadSnapshot:
        return LoadSnapshot(tuple(ReplicaLoad(i, 0, b, True) for i, b in busy.items()), 2, 0)

    async def remove(index: int) -> None:
        removed.append(index)

    async def scenario() -> None:
        scaler = Autoscaler("gen", config, load, asyncio.sleep, remove, interval_s=0.05)
        scaler.last_change -= 1
        await scaler.step()  # the first reading starts each replica's interval
        await asyncio.sleep(0.05)
        busy[1] += 0.05  # replica 1 was busy the whole interval
        await scaler.step()
        assert removed == []
        await asyncio.sleep(0.05)
        await scaler.step()  # nobody busy this interval
        assert removed == [1]

    asyncio.run(scenario())
