"""A 2-rank vLLM replica (TP=2, each rank's CPU communicator makes an 8 MiB file in
/dev/shm) at its procs' end, on 2 CPU slots: stopped, the procs exit by themselves within
the runtime's grace (no kill) and leave no file; a killed rank's file goes when its
replica is respawned, while the live rank's file and files nobody recorded stay. (vLLM's
CPU build for AVX2 machines has no shared-memory communicator: there, no file is made and
these tests are skipped.)"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

pytest.importorskip("vllm")

from colocate.engines.actors import GeneratorActor  # noqa: E402
from colocate.engines.sampling import SamplingParams  # noqa: E402
from colocate.engines.tiny import write_tiny_model  # noqa: E402
from colocate.shm_files import recorded  # noqa: E402
from services import ServiceConfig, spawn_service  # noqa: E402

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.usefixtures("vllm_preloaded", "procs_import_tests",
                                      "vllm_makes_shm_files")]

PROMPTS = [[1, 4, 5, 13, 6, 7, 14], [1, 10, 15]]
GREEDY = SamplingParams(max_new_tokens=4, temperature=0)


@pytest.fixture(scope="module")
def vllm_makes_shm_files():
    """vLLM's CPU communicator uses shared memory only where its build for this CPU has the
    `init_shm_manager` op (the AVX512 build; the AVX2 one falls back to torch.distributed
    and makes no /dev/shm file). Asked in a fresh process: loading vLLM's ops here would
    stay in the test process."""
    probe = subprocess.run(
        [sys.executable, "-c", "import torch, vllm._custom_ops; "
         "print(hasattr(torch.ops._C, 'init_shm_manager'))"],
        capture_output=True, text=True, timeout=300)
    if probe.stdout.strip().splitlines()[-1:] != ["True"]:
        pytest.skip("vLLM's CPU build for this CPU has no shared-memory communicator "
                    f"(torch CPU capability {torch_capability()}): no /dev/shm files to track")


def torch_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


@pytest.fixture
def model_dir(tmp_path):
    return str(write_tiny_model(tmp_path / "model", "qwen2", alphabet="0123456789+=>",
                                tie_embeddings=True, init_std=0.1, heads=2, kv_heads=2))


async def tp2_replica(model_dir: str, **config):
    service = await spawn_service(ServiceConfig(procs_per_host=2, resource_group="rl",
                                                **config),
                                  GeneratorActor, model_dir, engine="vllm", name="vllm",
                                  tensor_parallel_size=2)
    await service.generate.route(PROMPTS, GREEDY)
    replica = service.replicas[0]
    files = [recorded(pid) for pid in replica.allocation.pids]
    assert [len(f) for f in files] == [1, 1] and all(f[0].exists() for f in files), files
    return service, replica.allocation.pids, [f[0] for f in files]


async def test_stopped_vllm_procs_exit_by_themselves_and_leave_no_shared_memory(
        colocate_runtime, model_dir, caplog):
    rm = colocate_runtime
    _, pids, files = await tp2_replica(model_dir)
    with caplog.at_level(logging.WARNING, logger="colocate.resources.procs"):
        await rm.release("rl")
    assert "did not stop" not in caplog.text  # no kill: vLLM's destructor ran at exit
    assert not any(f.exists() for f in files)
    assert all(recorded(pid) == [] for pid in pids)


async def test_a_killed_ranks_shared_memory_goes_with_its_respawn_and_no_one_elses(
        colocate_runtime, model_dir):
    rm = colocate_runtime
    service, pids, files = await tp2_replica(model_dir)
    unrecorded = Path(f"{files[1]}-not-recorded")
    unrecorded.write_bytes(b"x")
    try:
        os.kill(pids[1], signal.SIGKILL)
        psutil.wait_procs([psutil.Process(pids[1])], timeout=30)
        assert files[1].exists()  # what vLLM would have removed at a normal exit
        await asyncio.wait_for(service.generate.route(PROMPTS, GREEDY), 300)  # respawned
        assert service.replicas[0].generation == 1
        assert not files[1].exists()  # removed for the dead rank, by its pid
        assert files[0].exists() and psutil.pid_exists(pids[0])  # a live rank's: kept
        assert unrecorded.exists()
        await rm.release("rl")  # the old rank 0's proc ends: its file goes then
        assert not files[0].exists() and unrecorded.exists()
    finally:
        unrecorded.unlink(missing_ok=True)
