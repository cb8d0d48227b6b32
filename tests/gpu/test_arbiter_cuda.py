"""Two tenants take turns on a GPU through the arbiter's logic, in a plain process per GPU
(the CUDA backend: torch_memory_saver; release verified with NVML by device UUID)."""

from __future__ import annotations

import asyncio
import hashlib

import torch

from colocate import telemetry
from colocate.arbiter import SlotArbiter, TaggedTenant
from colocate.arbiter.local import LocalTenantHandle

MiB = 1 << 20


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


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
        digests = {n: _digest(weights[n]) for n in tenants}
        arbiter = SlotArbiter([0])
        for name, tenant in tenants.items():
            await arbiter.register(0, LocalTenantHandle(name, tenant))
        used = []
        for _ in range(rounds):
            for name in ("generator", "trainer"):
                await arbiter.wake(name)
                weights[name + "/cache"].fill_(1.0)
                torch.cuda.synchronize()
                used.append(telemetry.read_gpu(0).used_bytes)
        intact = all(_digest(weights[n]) == d for n, d in digests.items())
        return {"status": arbiter.status()[0], "intact": intact, "first": used[1],
                "last": used[-1], "events": len(telemetry.timeline().events)}

    return asyncio.run(run())


def test_trainer_and_generator_take_turns_on_each_gpu(isolated, gpu_indices):
    for index in gpu_indices:
        out = isolated(turns_on_gpu, 256, 20, env={"CUDA_VISIBLE_DEVICES": str(index)})
        assert out["status"] == {"trainer": ["weights", "cache"], "generator": []}
        assert out["intact"]
        assert abs(out["last"] - out["first"]) < 0.02 * out["first"], out
        assert out["events"] >= 4 * 20  # every pause and resume was measured
