"""`ComputeThread`: engine work on a thread of the actor's own, whose malloc arena is apart
from the one Monarch's threads allocate from (the cause of the trim's unbounded growth,
bench/RESULTS.md, "A thread of its own for engine work")."""

from __future__ import annotations

import ctypes
import gc
import platform
import threading

import pytest
import torch
from monarch.actor import Actor, endpoint, this_host

from colocate.engines.actors import ReferenceActor, TrainerActor
from colocate.engines.compute_thread import ComputeThread
from colocate.engines.tiny import write_tiny_model
from services import ServiceConfig, spawn_service

pytestmark = pytest.mark.usefixtures("procs_import_tests")

GLIBC_HEAP_MAX = 64 << 20  # a glibc thread arena's heaps are aligned to this (64-bit)


def malloc_arena() -> int:
    """The address of the glibc malloc arena this thread allocates from (0: the main one)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    block = libc.malloc(64)
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                low, high = (int(x, 16) for x in line.split()[0].split("-"))
                if low <= block < high and line.rstrip().endswith("[heap]"):
                    return 0
        # a thread arena's heap starts with its heap_info, whose first field is the arena
        return ctypes.c_void_p.from_address(block & ~(GLIBC_HEAP_MAX - 1)).value
    finally:
        libc.free(block)


def test_a_call_runs_on_the_thread_and_gives_back_its_result_or_its_exception():
    compute = ComputeThread("unit-compute")
    assert compute.run(lambda a, b=0: (threading.current_thread().name, a + b), 1, b=2) \
        == ("unit-compute", 3)
    with pytest.raises(ZeroDivisionError):
        compute.run(lambda: 1 / 0)
    assert compute.run(lambda: "still serving") == "still serving"
    # a call made from the thread itself runs there at once instead of waiting for itself
    assert compute.run(lambda: compute.run(threading.get_ident)) == compute.thread.ident


def test_the_thread_ends_with_its_owner():
    compute = ComputeThread("short-lived")
    thread = compute.thread
    assert compute.run(lambda: 7) == 7
    del compute
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()


class ArenaProbe(Actor):
    """Where an endpoint's own thread allocates, and where its ComputeThread does."""

    def __init__(self) -> None:
        self.compute = ComputeThread("probe-compute")

    @endpoint
    def arenas(self) -> tuple[int, int]:
        return malloc_arena(), self.compute.run(malloc_arena)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc arenas")
@pytest.mark.timeout(120)
async def test_on_a_monarch_proc_the_compute_thread_allocates_from_an_arena_of_its_own():
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        probe = procs.spawn("probe", ArenaProbe)
        monarch_arena, compute_arena = await probe.arenas.call_one()
        assert monarch_arena != compute_arena
        # and it keeps it: the next call's allocations come from the same arena
        assert (await probe.arenas.call_one())[1] == compute_arena
    finally:
        await procs.stop()


def _where(module, batch):
    """A loss (or reference forward) that also says which thread ran it."""
    loss = module(input_ids=batch).logits.mean()
    return loss, {"thread": threading.current_thread().name}


@pytest.mark.timeout(300)
async def test_the_engine_actors_run_their_step_on_their_compute_thread(colocate_runtime,
                                                                         tmp_path):
    model = str(write_tiny_model(tmp_path / "model", "llama", alphabet="0123456789"))
    batch = torch.tensor([[1, 4, 5, 6]])
    trainer = await spawn_service(ServiceConfig(), TrainerActor, model, name="trainer")
    reference = await spawn_service(ServiceConfig(), ReferenceActor, model, name="ref")
    metrics = await trainer.train_step.route(_where, batch)
    _, ran = await reference.forward.route(_where, batch)
    assert metrics["thread"] == "trainer_r0-compute"  # <tenant name>-compute
    assert ran["thread"] == "ref_r0-compute"
