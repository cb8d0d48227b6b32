"""The tagged-memory layer on CPU: real release, real restore, checked transitions."""

from __future__ import annotations

import contextlib
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


def counted_trims() -> list[str]:
    """A list that grows by one each time this process gives back the allocators' memory
    (`release_cached`) from now on (an isolated scenario's own process)."""
    from colocate.memory import registry

    trims: list[str] = []
    trim = registry.release_cached

    def counted() -> None:
        trims.append("trim")
        trim()

    registry.release_cached = counted
    return trims


def one_trim_a_sleep_scenario() -> dict:
    """A two-stage tenant's sleep after it freed 64 MiB of small scratch tensors: how many
    times it gives back the allocators' memory, and what its two pauses record."""
    from colocate.arbiter.tenant import TaggedTenant

    trims = counted_trims()
    tenant = TaggedTenant({"weights": "trimmed/weights", "grads": "trimmed/grads"},
                          backup={"weights": True, "grads": False})
    kept = [_filled(MiB, seed=10), _filled(MiB, seed=11)]
    tenant.adopt(kept[0], "weights")
    tenant.adopt(kept[1], "grads")
    scratch = [torch.ones(16 * 1024) for _ in range(1024)]  # 64 KiB each
    pin = torch.ones(16 * 1024)
    del scratch
    before = _rss()
    tenant.sleep()
    events = telemetry.timeline().events[-2:]
    out = {"sleep_trims": len(trims), "tags": [e.tag for e in events],
           "drops": [before - e.after_bytes for e in events], "pinned": pin.numel()}
    memory.adopt(_filled(MiB, seed=12), "trimmed/alone")
    memory.pause("trimmed/alone")
    out["lone_pause_trims"] = len(trims) - out["sleep_trims"]
    return out


def capped_pause_scenario() -> dict:
    """Pauses of a CPU tag with and without a declared slot capacity: how many times each
    gives back the allocators' memory."""
    trims = counted_trims()
    memory.adopt(_filled(MiB, seed=20), "capped/alone")
    memory.set_capacity(64 * MiB)
    memory.pause("capped/alone")
    out = {"capped": len(trims)}
    memory.set_capacity(None)
    memory.resume("capped/alone")
    memory.pause("capped/alone")
    out["uncapped"] = len(trims) - out["capped"]
    return out


def storage_walks_scenario() -> dict:
    """How often a pause, a resume and a tenant's sleep walk a tag's storages (each walk
    revives every storage of the tag: a switch's pauses paid for two per tag)."""
    from colocate.arbiter.tenant import TaggedTenant
    from colocate.memory import registry

    walks: list[str] = []
    walk = registry.Tag.live_storages

    def counted(self: registry.Tag, device_type: str | None = None) -> list:
        walks.append(self.name)
        return walk(self, device_type)

    registry.Tag.live_storages = counted  # type: ignore[method-assign]
    held = _filled(MiB, seed=7)
    memory.adopt(held, "walked", backup=True)
    out = {"resident": memory.resident_bytes("walked")}
    walks.clear()
    out["returned"] = memory.pause("walked")
    out["pause_walks"] = len(walks)
    walks.clear()
    memory.resume("walked")
    out["resume_walks"] = len(walks)

    tenant = TaggedTenant({"weights": "walker/weights", "cache": "walker/cache"},
                          backup={"weights": True, "cache": False})
    kept = [_filled(MiB, seed=8), _filled(2 * MiB, seed=9)]  # a tag holds weak references
    tenant.adopt(kept[0], "weights")
    tenant.adopt(kept[1], "cache")
    walks.clear()
    out["slept"] = tenant.sleep()
    out["sleep_walks"] = sorted(walks)
    return out


# -- tests ------------------------------------------------------------------------------


def test_a_pause_returns_the_tags_bytes_and_each_switch_op_walks_its_storages_once(isolated):
    out = isolated(storage_walks_scenario)
    assert out["returned"] == out["resident"] == MiB
    assert out["pause_walks"] == 1
    assert out["resume_walks"] == 1
    assert out["slept"] == 3 * MiB  # the bytes the arbiter will check came back
    assert out["sleep_walks"] == ["walker/cache", "walker/weights"]


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


def test_a_sleep_of_several_stages_trims_once_and_reads_after_the_trim(isolated):
    """One malloc_trim a sleep (its cost grows as a long run fragments the heap), and every
    pause of the sleep records a reading taken after it, which shows the freed scratch."""
    out = isolated(one_trim_a_sleep_scenario)
    assert out["sleep_trims"] == 1
    assert out["lone_pause_trims"] == 1
    assert out["tags"] == ["trimmed/grads", "trimmed/weights"]
    assert all(drop >= 48 * MiB for drop in out["drops"]), out


def test_a_cpu_pause_under_a_slot_capacity_leaves_mallocs_free_lists(isolated):
    """A CPU slot's budget counts tagged memory only: its pauses do not trim the heap (the
    next train step would fault it back in); without a capacity they still do."""
    assert isolated(capped_pause_scenario) == {"capped": 0, "uncapped": 1}


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


def test_a_backup_saves_the_storages_bytes_not_the_huge_page_padding(tmp_path):
    from colocate.memory.arena import HUGE_PAGE, ArenaBackend
    from colocate.memory.registry import TagRegistry

    registry = TagRegistry()
    backend = registry._backends["cpu"] = ArenaBackend(backup_dir=str(tmp_path))
    small, large = _filled(300 * 1024, seed=10), _filled(HUGE_PAGE + 4096, seed=11)
    digests = [_digest(small), _digest(large)]
    registry.adopt(small, "padded", backup=True)  # one chunk, one huge page
    registry.adopt(large, "padded", backup=True)  # a second chunk: two huge pages
    chunks = backend.arenas["padded"].live_chunks()
    assert [len(c) for c in chunks] == [HUGE_PAGE, 2 * HUGE_PAGE]
    registry.pause("padded", place="disk")
    written = os.fstat(backend.arenas["padded"].backup.fd).st_size
    assert written == 300 * 1024 + HUGE_PAGE + 4096  # both sizes are multiples of ALIGN
    registry.resume("padded")
    assert [_digest(small), _digest(large)] == digests  # each chunk read from its offset
    assert backend.arenas["padded"].backup is None


def test_a_tags_next_backup_to_disk_rewrites_its_last_file_and_to_host_lets_it_go(tmp_path):
    from colocate.memory.arena import ArenaBackend
    from colocate.memory.registry import TagRegistry

    registry = TagRegistry()
    backend = registry._backends["cpu"] = ArenaBackend(backup_dir=str(tmp_path))
    t = _filled(3 * MiB, seed=12)
    registry.adopt(t, "again", backup=True)
    arena = backend.arenas["again"]
    registry.pause("again", place="disk")
    first = arena.backup
    registry.resume("again")
    assert arena.spare is first and not first.file.closed  # kept, not closed
    t.add_(1)  # the next backup must hold these bytes, not the file's old ones
    digest = _digest(t)
    registry.pause("again", place="disk")
    assert arena.backup is first  # the same file, rewritten
    registry.resume("again")
    assert _digest(t) == digest
    spare = arena.spare
    registry.pause("again", place="host")
    assert arena.spare is None and spare.file.closed  # the disk file is let go
    registry.resume("again")
    assert _digest(t) == digest


def test_failed_backup_leaves_the_tag_active_and_intact(tmp_path, monkeypatch):
    from colocate.memory.arena import ArenaBackend
    from colocate.memory.registry import TagRegistry

    registry = TagRegistry()
    registry._backends["cpu"] = ArenaBackend(backup_dir=str(tmp_path / "missing"))
    t = _filled(4 * MiB, seed=5)
    digest = _digest(t)
    registry.adopt(t, "fragile", backup=True)
    with pytest.raises(memory.TaggedMemoryError, match="still active"):
        registry.pause("fragile", place="disk")
    assert registry.state("fragile") is memory.TagState.ACTIVE
    assert _digest(t) == digest
    os.makedirs(tmp_path / "missing")
    registry.pause("fragile", place="disk")  # works once the cause is fixed
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


# -- torch 2.11: adopt without UntypedStorage._swap_data_ptr_ ----------------------------

class _Absent:
    """Makes `_swap_data_ptr_` absent, as on torch 2.11 (hasattr is False, a call fails)."""

    def __get__(self, obj, cls):
        raise AttributeError("'UntypedStorage' object has no attribute '_swap_data_ptr_'")


def _as_on_torch_2_11() -> None:
    torch.UntypedStorage._swap_data_ptr_ = _Absent()
    assert not hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def adopt_without_swap_scenario() -> dict:
    from colocate.memory import repoint

    _as_on_torch_2_11()
    out = {"mode": repoint.mode()}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 8))
    ref = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 8))
    ref.load_state_dict(model.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in (model, ref)]

    def step(m, opt, seed):
        g = torch.Generator().manual_seed(seed)
        loss = m(torch.randn(4, 512, generator=g)).pow(2).mean()
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        return loss.item()

    for m, opt in zip((model, ref), opts, strict=True):
        step(m, opt, 0)
    # a view that only autograd holds (linear's transposed weight, saved for a backward and
    # never a Python object) would keep the old memory
    scratch = torch.ones(1024)
    pending = torch.nn.functional.linear(torch.ones(2, 32, requires_grad=True),
                                         scratch.view(32, 32)).sum()
    try:
        memory.adopt(scratch, "scratch")
    except memory.TagConflictError as err:
        out["hidden_view_refused"] = "autograd" in str(err)
    out["nothing_adopted"] = "scratch" not in memory.tags() or \
        memory.tagged_bytes("scratch") == 0
    del pending
    # detached copies (state_dict() values, as the engines adopt) bring the parameters along
    ptr = model[0].weight.data_ptr()
    adopted = memory.adopt(list(model.state_dict().values()), "policy", backup=True)
    adopted += memory.adopt([model, opts[0]], "policy", backup=True)
    out["adopted_all"] = adopted == memory.tagged_bytes("policy") > 3 * 512 * 512 * 4
    out["moved"] = model[0].weight.data_ptr() != ptr  # the parameter itself follows
    ptr = model[0].weight.data_ptr()
    before = _rss()
    memory.pause("policy")
    out["released"] = before - _rss()
    out["expected"] = adopted
    memory.resume("policy")
    out["same_ptr"] = model[0].weight.data_ptr() == ptr
    out["trains_on"] = [step(model, opts[0], s) for s in range(1, 4)] == \
        [step(ref, opts[1], s) for s in range(1, 4)]
    try:
        with memory.region("built", device="cpu"):
            pass
    except memory.TaggedMemoryError as err:
        out["region_refused"] = "adopt" in str(err) and "2.12" in str(err)
    return out


def test_adopt_works_on_a_torch_without_swap_data_ptr(isolated):
    out = isolated(adopt_without_swap_scenario)
    assert out["mode"] == "set"
    assert out["hidden_view_refused"] and out["nothing_adopted"], out
    assert out["adopted_all"] and out["moved"], out
    assert out["released"] >= 0.9 * out["expected"], out
    assert out["same_ptr"] and out["trains_on"], out
    assert out["region_refused"], out


def test_forced_set_mode_keeps_contents_and_addresses_across_cycles(isolated):
    out = isolated(two_tenants_scenario, env={"COLOCATE_REPOINT": "set"})
    assert out["trainer_released"] >= 0.95 * 256 * MiB
    assert out["trainer_identical"] and out["trainer_same_ptr"]
    assert out["generator_released"] >= 0.95 * 256 * MiB
    assert out["generator_zeroed"] and out["generator_usable"] == 7


# -- a pause while a region of the tag is open ---------------------------------------------

def test_pause_is_refused_while_a_region_of_the_tag_is_open_in_another_thread():
    import threading

    opened, finish = threading.Event(), threading.Event()

    def fill():
        with memory.region("filling", device="cpu"):
            opened.set()
            finish.wait(10)
            fill.tensor = torch.ones(1024)

    worker = threading.Thread(target=fill, name="filler")
    worker.start()
    assert opened.wait(10)
    try:
        with pytest.raises(memory.TagStateError, match="region open in thread.*filler"):
            memory.pause("filling")
        assert memory.state("filling") is memory.TagState.ACTIVE
    finally:
        finish.set()
        worker.join(10)
    assert memory.tagged_bytes("filling") == 4096
    memory.pause("filling")  # once the region ended
    assert memory.resident_bytes("filling") == 0
    memory.resume("filling")


def test_pause_is_refused_inside_the_tags_own_region():
    with memory.region("self-pausing", device="cpu"):
        keep = torch.ones(1024)
        with pytest.raises(memory.TagStateError, match="region open"):
            memory.pause("self-pausing")
    memory.pause("self-pausing")
    memory.resume("self-pausing")
    assert keep.numel() == 1024


# -- CUDA decisions, each tested with the one CUDA fact injected -------------------------

def test_expandable_segments_are_refused_in_either_variable():
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        for conf in ("expandable_segments:True",
                     "max_split_size_mb:128, expandable_segments: true"):
            with pytest.raises(memory.CudaSetupError, match=name):
                memory.check_allocator_conf({name: conf})
        memory.check_allocator_conf({name: "expandable_segments:False"})


class _Pool:
    def __init__(self, sizes):
        self.sizes = sizes

    def snapshot(self):
        return [{"total_size": size} for size in self.sizes]


class _Saver:
    """Stands in for torch_memory_saver, whose resume would exit(1) out of memory."""

    def __init__(self, pools):
        self._impl = type("Impl", (), {"_mem_pools": pools})()
        self.resumed = []

    def resume(self, tag):
        self.resumed.append(tag)

    def pause(self, tag):
        self.resumed.remove(tag)


def _cuda_backend(saver, free_bytes):
    from colocate.memory.cuda import CudaBackend
    from colocate.memory.pinned import PinnedBackup

    backend = object.__new__(CudaBackend)  # no CUDA here: only the resume decision runs
    backend.saver, backend.free_bytes = saver, lambda device: free_bytes
    backend.backup = PinnedBackup(pin=False)
    return backend


def test_a_resume_that_does_not_fit_raises_instead_of_reaching_torch_memory_saver():
    from colocate.memory.cuda import RESUME_HEADROOM_BYTES

    pools = {("kv", False, False, "", 0): _Pool([512 * MiB, 512 * MiB]),
             ("other", False, False, "", 0): _Pool([4096 * MiB])}
    saver = _Saver(pools)
    # the live tensors hold 100 MiB, the tag's pool segments 1 GiB: 1 GiB must be free
    short = _cuda_backend(saver, 1024 * MiB)
    with pytest.raises(memory.ResumeOutOfMemoryError, match=r"1024 MiB on cuda:0.*stays paused"):
        short.resume("kv", 100 * MiB, 0)
    assert saver.resumed == []
    _cuda_backend(saver, 1024 * MiB + RESUME_HEADROOM_BYTES).resume("kv", 100 * MiB, 0)
    assert saver.resumed == ["kv"]
    # without readable pools the live bytes count
    _cuda_backend(_Saver(None), 100 * MiB + RESUME_HEADROOM_BYTES).resume("kv", 100 * MiB, 0)


def test_cuda_memory_off_the_current_device_is_refused():
    from colocate.memory.registry import check_cuda_device

    check_cuda_device("t", torch.device("cuda", 1), current=1, tag_index=None)
    with pytest.raises(memory.TagConflictError, match=r"set_device\(1\)"):
        check_cuda_device("t", torch.device("cuda", 1), current=0, tag_index=None)
    with pytest.raises(memory.TagConflictError, match="one tag per device"):
        check_cuda_device("t", torch.device("cuda", 1), current=1, tag_index=0)
    check_cuda_device("t", torch.device("cpu"), current=0, tag_index=0)


def test_preload_env_puts_torchs_cuda_libraries_on_the_library_path(tmp_path):
    from colocate.memory.cuda import cuda_library_dirs

    for name in ("cu13", "cuda_runtime", "cublas"):
        (tmp_path / "nvidia" / name / "lib").mkdir(parents=True)
    (tmp_path / "nvidia" / "nccl" / "lib").mkdir(parents=True)
    dirs = cuda_library_dirs(tmp_path)
    assert [d.split("/")[-2] for d in dirs] == ["cu13", "cublas", "cuda_runtime"]
    env = memory.preload_env({"LD_LIBRARY_PATH": f"/opt/x:{dirs[0]}", "LD_PRELOAD": "/a.so"},
                             library_dirs=dirs)
    assert env["LD_LIBRARY_PATH"] == ":".join([*dirs, "/opt/x"])
    assert env["LD_PRELOAD"].endswith(":/a.so") and "torch_memory_saver" in env["LD_PRELOAD"]


def test_preload_mode_is_refused_when_cudamalloc_is_not_the_hook():
    from colocate.memory.cuda import check_preload_hook, symbol_owner

    # the lookup that finds cudaMalloc's library, on a symbol this process has
    assert os.path.basename(symbol_owner("malloc")).startswith("libc.so")
    assert symbol_owner("no_such_symbol_anywhere") is None

    hook = "/site/torch_memory_saver_hook_mode_preload_cu13.abi3.so"
    check_preload_hook(hook)
    for owner in ("/site/nvidia/cu13/lib/libcudart.so.13", None):
        with pytest.raises(memory.CudaSetupError, match="preload_env"):
            check_preload_hook(owner)


def preload_hook_scenario() -> dict:
    from colocate.memory.cuda import check_preload_hook, cuda_malloc_owner, hook_mode

    with open("/proc/self/maps") as maps:
        out = {"mapped": "torch_memory_saver_hook_mode_preload" in maps.read(),
               "mode": hook_mode(os.environ), "owner": cuda_malloc_owner()}
    try:
        check_preload_hook(out["owner"])
    except memory.CudaSetupError as err:
        out["refused"] = str(err)
    return out


def test_preload_mode_is_refused_when_the_loader_skipped_the_hook(isolated):
    # The loader only warns ("cannot be preloaded: ignored") when LD_PRELOAD names a file it
    # cannot open (a path from another host's layout, say); the process starts unhooked.
    # (A hook whose libcudart or libcuda is missing fails the start instead, status 127.)
    missing = "/nonexistent/torch_memory_saver_hook_mode_preload_cu13.abi3.so"
    out = isolated(preload_hook_scenario,
                   env={"LD_PRELOAD": missing, "COLOCATE_TMS_HOOK_MODE": "preload"})
    assert out["mode"] == "preload" and not out["mapped"], out  # the env check is fooled
    assert "cudaMalloc is defined by no loaded library" in out["refused"], out


def test_pools_kept_alive_at_exit_are_never_finalized(tmp_path):
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import sys
        from colocate.memory.cuda import keep_alive_at_exit

        class Pool:  # stands in for torch's MemPool, whose destructor frees through TMS
            def __del__(self):
                print("finalized", flush=True)

        pools = {"tag": Pool()}
        if sys.argv[1] == "keep":
            keep_alive_at_exit(lambda: list(pools.values()))
    """)
    runs = {how: subprocess.run([sys.executable, "-c", script, how], capture_output=True,
                                text=True, timeout=120, env={**os.environ})
            for how in ("keep", "plain")}
    assert runs["plain"].stdout.strip() == "finalized"  # what happens to TMS's pools today
    assert runs["keep"].returncode == 0 and runs["keep"].stdout == "", runs["keep"]


def test_a_pinned_backup_restores_every_storage_and_reuses_its_memory():
    from colocate.memory.pinned import PinnedBackup

    backup = PinnedBackup(pin=False)  # the CUDA backend's; CPU storages stand in here
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g)
               for n in (3, 4096, 1 << 20, 5 << 20, 0)]
    wide = torch.randn(1000, generator=g, dtype=torch.float64)
    view = wide[10:20]  # a view: its storage is the whole of `wide`'s, saved once
    storages = [t.untyped_storage() for t in (*tensors, wide)]
    expected = [t.clone() for t in (*tensors, wide)]
    backup.save("w", storages)  # not reserved: the save grows it
    chunks = list(backup.tags["w"].chunks)
    assert backup.capacity("w") == sum(s.nbytes() for s in storages)
    for t in (*tensors, wide):
        t.zero_()  # what an unmapped and mapped-again allocation may hold
    backup.restore("w")
    assert all(torch.equal(t, e) for t, e in zip((*tensors, wide), expected, strict=True))
    assert torch.equal(view, expected[-1][10:20])
    assert "w" not in backup.saved
    backup.restore("w")  # nothing saved: nothing to do
    backup.save("w", storages[:2])  # smaller: the same memory
    assert backup.tags["w"].chunks == chunks
    bigger = torch.ones(backup.capacity("w") + 1, dtype=torch.uint8)
    backup.save("w", [bigger.untyped_storage()])  # larger: one byte more, not a new copy
    assert [c.numel() for c in backup.tags["w"].chunks] == [chunks[0].numel(), 1]
    backup.drop("w")  # a pause that did not happen: nothing is restored
    bigger.zero_()
    backup.restore("w")
    assert int(bigger.sum()) == 0


def test_a_backed_up_tag_is_pinned_as_it_gets_memory_and_its_pause_only_copies(monkeypatch):
    """`claim` (a region's end) and `adopt` pin a backed-up tag's host memory for its
    storages; the pause then copies into it and pins nothing. A tag without backup pins
    nothing. The host memory follows the tag's live bytes: storages let go make room for
    new ones."""
    from colocate.memory import pinned
    from colocate.memory.repoint import Held

    pinned_now: list[int] = []
    make = pinned.pinned_host

    def counted(nbytes: int, pin: bool = True) -> torch.Tensor:
        pinned_now.append(nbytes)
        return make(nbytes, pin)

    monkeypatch.setattr(pinned, "pinned_host", counted)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)  # no CUDA here
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    saver = _Saver(None)
    saver.region = lambda tag, enable_cpu_backup: contextlib.nullcontext()
    backend = _cuda_backend(saver, 1 << 40)
    weights = [torch.randn(1000), torch.randn(10)]
    backend.claim("w", [t.untyped_storage() for t in weights], backup=True)
    assert pinned_now == [4040]
    backend.claim("cache", [torch.zeros(4096).untyped_storage()], backup=False)
    assert pinned_now == [4040]  # no backup: nothing pinned
    optimizer = torch.randn(300)
    held = [Held(optimizer.untyped_storage(), [optimizer])]
    backend.adopt("w", held, backup=True)  # as `memory.adopt` moves it under the tag
    assert pinned_now == [4040, 1200]
    expected = [t.clone() for t in (*weights, optimizer)]
    live = [t.untyped_storage() for t in (*weights, optimizer)]
    backend.backup.save("w", live)  # the pause's copy
    assert pinned_now == [4040, 1200]  # nothing pinned at the pause
    for t in (*weights, optimizer):
        t.zero_()
    backend.backup.restore("w")
    assert all(torch.equal(t, e) for t, e in zip((*weights, optimizer), expected, strict=True))
    del weights[0], live  # 4000 bytes let go...
    backend.claim("w", [torch.ones(900).untyped_storage()], backup=True)
    assert pinned_now == [4040, 1200]  # ...hold the 3600 new ones


def test_many_small_storages_cross_in_staged_batches_over_chunk_boundaries(monkeypatch):
    """Storages under `SMALL_BYTES` are gathered into staging batches of at most
    `STAGE_BYTES` (one `_foreach_copy_` each way) and each batch is copied as one span of
    the tag's memory, across the chunks its growth made; every byte comes back."""
    from colocate.memory import pinned

    monkeypatch.setattr(pinned, "SMALL_BYTES", 256)
    monkeypatch.setattr(pinned, "STAGE_BYTES", 1000)
    together: list[int] = []
    foreach_copy = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda targets, sources: (
        together.append(len(targets)), foreach_copy(targets, sources)))
    backup = pinned.PinnedBackup(pin=False)
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g)
               for n in [100] * 25 + [300, 700, 7]]
    storages = [t.untyped_storage() for t in tensors]
    for i in range(0, len(storages), 5):  # grown in five steps: five chunks
        backup.reserve("many", storages[i:i + 5 + 1])
    assert len(backup.tags["many"].chunks) > 2
    assert backup.capacity("many") == sum(s.nbytes() for s in storages)
    expected = [t.clone() for t in tensors]
    backup.save("many", storages)
    assert together == [10, 10, 6]  # 26 small ones in batches of at most 1000 bytes
    for t in tensors:
        t.zero_()
    backup.restore("many")
    assert together == [10, 10, 6] * 2
    assert all(torch.equal(t, e) for t, e in zip(tensors, expected, strict=True))


def test_a_failed_copy_back_leaves_the_tag_paused_with_its_backup_for_a_retry(monkeypatch):
    from colocate.memory.cuda import RESUME_HEADROOM_BYTES
    from colocate.memory.pinned import PinnedBackup

    saver = _Saver(None)
    backend = _cuda_backend(saver, 64 * MiB + RESUME_HEADROOM_BYTES)
    weights = torch.arange(1000, dtype=torch.float32)
    backend.backup.save("w", [weights.untyped_storage()])  # as a pause did
    weights.zero_()
    restore = PinnedBackup.restore

    def fails(self, tag):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(PinnedBackup, "restore", fails)
    with pytest.raises(RuntimeError, match="copy failed"):
        backend.resume("w", 4000, 0)
    assert saver.resumed == [] and "w" in backend.backup.saved  # paused again, still saved
    monkeypatch.setattr(PinnedBackup, "restore", restore)
    backend.resume("w", 4000, 0)
    assert saver.resumed == ["w"] and torch.equal(weights, torch.arange(1000.0))
