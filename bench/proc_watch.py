"""How fast a call in flight in a proc that dies ends, with no switch running; and what the
always-on proc watch costs the arbiter when nothing dies.

Two MemoryTenant services of 2 replicas share a group of 2 CPU slots. First the runtime is
left idle for 20 s and the arbiter proc's CPU time read (psutil); then, `n` times (argv[1],
default 5), a call that sleeps 10 s is sent to replica 0 of the first service, its proc is
SIGKILLed 0.3 s later, and the time from the kill until the call raises is printed.

    python -m bench.proc_watch [n]
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import psutil

from colocate.resources.manager import ResourceManager
from colocate.resources.procs import ProcProbe
from colocate.testing import MemoryTenant, start_runtime
from services import ReplicaLostError, ServiceConfig, spawn_service

IDLE_S = 20.0


async def arbiter_procs(rm: ResourceManager) -> list[psutil.Process]:
    """The processes of this runtime's arbiter procs, as they tell their pids."""
    probe = rm.arbiter_procs.spawn("probe", ProcProbe)
    return [psutil.Process(info["pid"]) for _, info in (await probe.info.call()).items()]


def cpu_s(procs: list[psutil.Process]) -> float:
    return sum(p.cpu_times().user + p.cpu_times().system for p in procs)


async def main(n: int) -> None:
    async with start_runtime(gpus_per_host=2) as rm:
        services = [await spawn_service(ServiceConfig(num_replicas=2, resource_group="g"),
                                        MemoryTenant, 1, name=f"s{i}") for i in range(2)]
        procs = await arbiter_procs(rm)
        before = cpu_s(procs)
        await asyncio.sleep(IDLE_S)
        used = cpu_s(procs) - before
        print(f"idle {IDLE_S:.0f} s: {len(procs)} arbiter proc(s), {used:.3f} s of CPU "
              f"({100 * used / IDLE_S:.2f}% of a core)")
        seen = []
        replica = services[0].replicas[0]
        for _ in range(n):
            while replica.state.value != "healthy":
                await asyncio.sleep(0.05)
            pid = (await replica.actors.memory.call_one())["pid"]
            call = asyncio.ensure_future(replica.call("work", (1, 10.0), {}))
            while not replica.in_flight:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # running in the proc now
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            try:
                await call
            except ReplicaLostError:
                pass
            except Exception as err:  # before the proc watch: Monarch's own report
                print("ended by", type(err).__name__)
            seen.append(time.monotonic() - killed)
        print("kill -> ReplicaLostError s:", " ".join(f"{s:.3f}" for s in seen))


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 5))
