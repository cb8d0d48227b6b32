"""Two tenants take turns on a GPU through the arbiter's logic, in a plain process per GPU,
all GPUs at once (the CUDA backend: torch_memory_saver; release verified with NVML)."""

from __future__ import annotations

import asyncio

import torch

from colocate import memory, telemetry
from colocate.arbiter import SlotArbiter, TaggedTenant
from colocate.arbiter.local import LocalTenantHandle

MiB = 1 << 20


def _used() -> int:
    torch.cuda.synchronize()
    return telemetry.read_gpu_process(0).used_bytes


def turns_on_gpu(mib: int, rounds: int) -> dict:
    async def run():
        tenants, weights = {}, {}
        for seed, name in enumerate(("trainer", "generator")):
            tenant = TaggedTenant({"weights": f"{name}/weights", "cache": f"{name}/cache"},
                                  backup={"weights": True, "cache": False})
            g = torch.Generator(device="cuda").manual_seed(seed)
            with tenant.region("weights", device="cuda"):
                weights[name] = torch.randint(0, 2**31, (mib * MiB // 4,), dtype=torch.int32,
                                              device="cuda", generator=g)
            with tenant.region("cache", device="cuda"):
                weights[name + "/cache"] = torch.zeros(mib * MiB // 4, device="cuda")
            tenants[name] = tenant
        # copied while both are awake (a sleeping tenant's memory is unmapped on CUDA),
        # untagged, and compared on the device, not hashed through host memory (a copy
        # and a SHA-256 of 256 MiB at each of the 40 wakes)
        references = {n: weights[n].clone() for n in tenants}
        arbiter = SlotArbiter([0])
        for name, tenant in tenants.items():
            await arbiter.register(0, LocalTenantHandle(name, tenant))
        used, intact, asleep = [], [], []
        for _ in range(rounds):
            for name, other in (("generator", "trainer"), ("trainer", "generator")):
                await arbiter.wake(name)
                intact.append(bool(torch.equal(weights[name], references[name])))  # awake
                asleep.append(memory.resident_bytes(f"{other}/weights")
                              + memory.resident_bytes(f"{other}/cache"))
                weights[name + "/cache"].fill_(1.0)
                used.append(_used())
        return {"status": arbiter.status()[0], "intact": all(intact), "wakes": len(intact),
                "other_resident": max(asleep), "first": used[1], "last": used[-1],
                "events": telemetry.timeline().recorded}

    return asyncio.run(run())


def test_trainer_and_generator_take_turns_on_each_gpu(on_each_gpu, hook_env):
    for out in on_each_gpu(turns_on_gpu, 256, 20, env=hook_env):
        assert out["status"] == {"trainer": ["weights", "cache"], "generator": []}
        assert out["intact"] and out["wakes"] == 40, out  # each wake found its weights
        assert out["other_resident"] == 0, out  # the other tenant slept at every turn
        assert abs(out["last"] - out["first"]) < 0.02 * out["first"], out
        assert out["events"] >= 4 * 20  # every pause and resume was measured
