"""The tagged-memory layer on CUDA (torch_memory_saver), on every GPU present.

Each scenario runs in a fresh process pinned to one GPU with CUDA_VISIBLE_DEVICES, and
measures the GPU's used memory with NVML.
"""

from __future__ import annotations

import hashlib

import torch

from colocate import memory, telemetry

MiB = 1 << 20


def _used() -> int:
    torch.cuda.synchronize()
    return telemetry.read_gpu(0).used_bytes


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


def two_tenants_on_gpu() -> dict:
    g = torch.Generator(device="cuda").manual_seed(1)
    with memory.region("trainer", backup=True, device="cuda"):
        trainer = torch.randint(0, 2**31, (256 * MiB // 4,), dtype=torch.int32,
                                device="cuda", generator=g)
    generator = torch.full((256 * MiB // 4,), 3, dtype=torch.int32, device="cuda")
    memory.adopt(generator, "generator", backup=False)  # adopt an existing CUDA tensor
    digest, ptr = _digest(trainer), trainer.data_ptr()
    out = {"tagged": memory.tagged_bytes("trainer"), "adopted": memory.tagged_bytes("generator")}

    before = _used()
    memory.pause("trainer")
    out["trainer_released"] = before - _used()
    memory.resume("trainer")
    out["identical"] = _digest(trainer) == digest
    out["same_ptr"] = trainer.data_ptr() == ptr

    before = _used()
    memory.pause("generator")
    out["generator_released"] = before - _used()
    low = _used()
    memory.resume("generator")
    out["generator_regained"] = _used() - low
    generator.fill_(7)
    out["generator_usable"] = int(generator[-1].item())
    return out


def cycles_on_gpu(cycles: int) -> dict:
    with memory.region("kept", backup=True, device="cuda"):
        kept = torch.arange(32 * MiB // 4, dtype=torch.int32, device="cuda")
    with memory.region("scratch", device="cuda"):
        torch.empty(32 * MiB // 4, device="cuda").fill_(1)
        scratch = torch.empty(32 * MiB // 4, device="cuda")
    digest = _digest(kept)
    used = []
    for _ in range(cycles):
        memory.pause("kept")
        memory.pause("scratch")
        memory.resume("scratch")
        memory.resume("kept")
        used.append(_used())
    scratch.fill_(0)
    return {"first": used[0], "last": used[-1], "identical": _digest(kept) == digest}


def bad_transitions_on_gpu() -> list[str]:
    with memory.region("t", device="cuda"):
        x = torch.ones(1024, device="cuda")
    raised = []
    for bad in (lambda: memory.resume("t"), lambda: memory.pause("nope")):
        try:
            bad()
        except memory.TaggedMemoryError as err:
            raised.append(type(err).__name__)
    memory.pause("t")
    try:
        memory.pause("t")
    except memory.TagStateError as err:
        raised.append(type(err).__name__)
    memory.resume("t")
    x.fill_(2)
    raised.append(str(int(x.sum().item())))
    return raised


def _on_each_gpu(isolated, gpu_indices, fn, *args):
    return [isolated(fn, *args, env={"CUDA_VISIBLE_DEVICES": str(i)}) for i in gpu_indices]


def test_pause_releases_gpu_memory_and_resume_restores(isolated, gpu_indices):
    for out in _on_each_gpu(isolated, gpu_indices, two_tenants_on_gpu):
        assert out["tagged"] == out["adopted"] == 256 * MiB
        assert out["trainer_released"] >= 0.95 * 256 * MiB, out
        assert out["identical"] and out["same_ptr"], out
        assert out["generator_released"] >= 0.95 * 256 * MiB, out
        assert out["generator_regained"] >= 0.95 * 256 * MiB, out
        assert out["generator_usable"] == 7


def test_thousand_gpu_cycles_do_not_drift(isolated, gpu_indices):
    for out in _on_each_gpu(isolated, gpu_indices, cycles_on_gpu, 1000):
        assert out["identical"]
        assert abs(out["last"] - out["first"]) < 0.01 * out["first"], out


def test_bad_transitions_never_reach_torch_memory_saver(isolated, gpu_indices):
    for raised in _on_each_gpu(isolated, gpu_indices, bad_transitions_on_gpu):
        assert raised == ["TagStateError", "UnknownTagError", "TagStateError", "2048"]


def test_preload_hook_mode_in_a_process_started_for_it(isolated, gpu_indices):
    env = {k: v for k, v in memory.preload_env().items()
           if k in ("LD_PRELOAD", "COLOCATE_TMS_HOOK_MODE")}
    out = isolated(two_tenants_on_gpu, env={**env, "CUDA_VISIBLE_DEVICES": str(gpu_indices[0])})
    assert out["trainer_released"] >= 0.95 * 256 * MiB, out
    assert out["identical"] and out["same_ptr"], out
