"""The tagged-memory layer on CPU: real release, real restore, checked transitions."""

from __future__ import annotations

import hashlib
import os

import psutil
import pytest
import torch

from colocate import memory, telemetry

MiB = 1 << 20


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _filled(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**31, (nbytes // 4,), dtype=torch.int32, generator=g)


# -- scenarios that run in a fresh process ----------------------------------------------

def two_tenants_scenario() -> dict:
    trainer = _filled(256 * MiB, seed=1)
    generator = _filled(256 * MiB, seed=2)
    memory.adopt(trainer, "trainer", backup=True)
    memory.adopt(generator, "generator", backup=False)
    digest, ptr = _digest(trainer), trainer.data_ptr()
    out = {"trainer_bytes": memory.resident_bytes("trainer")}

    before = _rss()
    memory.pause("trainer")
    out["trainer_released"] = before - _rss()
    out["paused_resident"] = memory.resident_bytes("trainer")
    memory.resume("trainer")
    out["trainer_identical"] = _digest(trainer) == digest
    out["trainer_same_ptr"] = trainer.data_ptr() == ptr

    before = _rss()
    memory.pause("generator")
    out["generator_released"] = before - _rss()
    low = _rss()
    memory.resume("generator")
    out["generator_regained"] = _rss() - low
    out["generator_zeroed"] = bool((generator == 0).all())
    generator.fill_(7)  # the resumed memory is usable
    out["generator_usable"] = int(generator[-1])
    return out


def cycles_scenario(cycles: int) -> dict:
    kept = _filled(32 * MiB, seed=3)
    scratch = _filled(32 * MiB, seed=4)
    memory.adopt(kept, "kept", backup=True)
    memory.adopt(scratch, "scratch")
    digest = _digest(kept)
    rss = []
    for _ in range(cycles):
        memory.pause("kept")
        memory.pause("scratch")
        memory.resume("scratch")
        memory.resume("kept")
        rss.append(_rss())
    return {"first": rss[0], "last": rss[-1], "max": max(rss),
            "identical": _digest(kept) == digest}


def freed_scratch_scenario() -> dict:
    """A tenant that freed 64 MiB of small untagged tensors (activations, say) while one
    later allocation pins the top of the heap, so malloc keeps the pages."""
    from colocate.arbiter.tenant import TaggedTenant

    tenant = TaggedTenant({"weights": "scratch-owner/weights"}, backup={"weights": True})
    weights = _filled(MiB, seed=6)
    tenant.adopt(weights, "weights")
    scratch = [torch.ones(16 * 1024) for _ in range(1024)]  # 64 KiB each
    pin = torch.ones(16 * 1024)
    del scratch
    before = _rss()
    expected = tenant.sleep()
    event = telemetry.timeline().events[-1]
    alive = pin.numel() + weights.numel()  # both held until here
    return {"expected": expected, "slept": before - _rss(), "alive": alive,
            "recorded": event.before_bytes - event.after_bytes}


# -- tests ------------------------------------------------------------------------------

def test_pause_releases_and_resume_restores_in_place(isolated):
    out = isolated(two_tenants_scenario)
    assert out["trainer_bytes"] == 256 * MiB
    assert out["trainer_released"] >= 0.95 * 256 * MiB
    assert out["paused_resident"] == 0
    assert out["trainer_identical"] and out["trainer_same_ptr"]
    assert out["generator_released"] >= 0.95 * 256 * MiB
    assert out["generator_regained"] >= 0.95 * 256 * MiB  # discard mode holds memory again
    assert out["generator_zeroed"] and out["generator_usable"] == 7


def test_thousand_cycles_do_not_drift(isolated):
    out = isolated(cycles_scenario, 1000)
    assert out["identical"]
    assert abs(out["last"] - out["first"]) < 0.01 * out["first"], out
    assert out["max"] - out["first"] < 0.01 * out["first"], out


def test_a_pause_gives_back_freed_untagged_memory(isolated):
    out = isolated(freed_scratch_scenario)
    assert out["expected"] == MiB  # the arbiter expects the tagged bytes back...
    assert out["slept"] >= 48 * MiB, out  # ...and the pause returns malloc's pages as well
    assert out["recorded"] >= 48 * MiB, out  # the timeline's reading after it shows that


def test_bad_transitions_raise_and_the_process_goes_on():
    t = torch.ones(1024)
    memory.adopt(t, "transitions")
    with pytest.raises(memory.TagStateError, match="already active"):
        memory.resume("transitions")
    memory.pause("transitions")
    with pytest.raises(memory.TagStateError, match="already paused"):
        memory.pause("transitions")
    with pytest.raises(memory.TagPausedError, match="paused"):
        memory.ensure_active("transitions")
    with pytest.raises(memory.TagPausedError, match="resume"):
        memory.adopt(torch.ones(8), "transitions")
    with pytest.raises(memory.TagPausedError):
        with memory.region("transitions", device="cpu"):
            pass
    with pytest.raises(memory.UnknownTagError, match="never-made"):
        memory.pause("never-made")
    with pytest.raises(memory.UnknownTagError):
        memory.resume("never-made")
    memory.resume("transitions")  # still usable after all of that
    memory.ensure_active("transitions")
    assert t.sum().item() == 0  # no backup: contents were discarded
    t += 1
    assert t.sum().item() == 1024


def test_conflicts_are_refused_before_anything_moves():
    t = torch.arange(100.0)
    memory.adopt(t, "owner-a", backup=True)
    with pytest.raises(memory.TagConflictError, match="owner-a"):
        memory.adopt(t[10:], "owner-b")
    with pytest.raises(memory.TagConflictError, match="backup=True"):
        memory.adopt(torch.ones(4), "owner-a", backup=False)
    with pytest.raises(memory.TagConflictError, match="nest"):
        with memory.region("outer", device="cpu"):
            with memory.region("inner", device="cpu"):
                pass
    assert "owner-b" not in memory.tags() or memory.tagged_bytes("owner-b") == 0
    assert torch.equal(t, torch.arange(100.0))
    with pytest.raises(memory.TaggedMemoryError, match="non-empty string"):
        memory.adopt(torch.ones(4), "")


def test_region_tags_what_is_allocated_inside():
    with memory.region("built", backup=True, device="cpu"):
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
        scratch = torch.randn(1000)
        del scratch
    expected = sum(p.nbytes for p in model.parameters())
    assert memory.tagged_bytes("built") == expected
    x = torch.randn(4, 64)
    y = model(x)
    memory.pause("built")
    memory.resume("built")
    assert torch.equal(model(x), y)


def test_module_and_optimizer_train_on_after_pause():
    def make():
        torch.manual_seed(0)
        model = torch.nn.Linear(32, 1)
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    def step(model, opt, seed):
        g = torch.Generator().manual_seed(seed)
        loss = model(torch.randn(8, 32, generator=g)).pow(2).mean()
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        return loss.item()

    ref_model, ref_opt = make()
    model, opt = make()
    step(ref_model, ref_opt, 0)
    step(model, opt, 0)
    adopted = memory.adopt([model, opt], "policy", backup=True)
    assert adopted == memory.tagged_bytes("policy") > 3 * 33 * 4  # params, grads, 2 moments
    memory.pause("policy")
    memory.resume("policy")
    assert [step(ref_model, ref_opt, s) for s in range(1, 4)] == \
        [step(model, opt, s) for s in range(1, 4)]


def test_failed_backup_leaves_the_tag_active_and_intact(tmp_path, monkeypatch):
    from colocate.memory.arena import ArenaBackend
    from colocate.memory.registry import TagRegistry

    registry = TagRegistry()
    registry._backends["cpu"] = ArenaBackend(backup_dir=str(tmp_path / "missing"))
    t = _filled(4 * MiB, seed=5)
    digest = _digest(t)
    registry.adopt(t, "fragile", backup=True)
    with pytest.raises(memory.TaggedMemoryError, match="still active"):
        registry.pause("fragile")
    assert registry.state("fragile") is memory.TagState.ACTIVE
    assert _digest(t) == digest
    os.makedirs(tmp_path / "missing")
    registry.pause("fragile")  # works once the cause is fixed
    registry.resume("fragile")
    assert _digest(t) == digest


def test_cuda_setup_errors_name_the_fix(monkeypatch):
    from colocate.memory.cuda import hook_mode

    with pytest.raises(memory.CudaSetupError, match="expandable_segments"):
        memory.check_allocator_conf({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    memory.check_allocator_conf({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    with pytest.raises(memory.CudaSetupError, match="preload_env"):
        hook_mode({"COLOCATE_TMS_HOOK_MODE": "preload"})
    with pytest.raises(memory.CudaSetupError, match="one of"):
        hook_mode({"COLOCATE_TMS_HOOK_MODE": "magic"})
    env = memory.preload_env({})
    assert os.path.exists(env["LD_PRELOAD"]) and hook_mode(env) == "preload"
    assert hook_mode({}) == "torch"
