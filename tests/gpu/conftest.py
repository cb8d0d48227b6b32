"""GPU tests: marked `gpu` (select them with `-m gpu`), skipped without CUDA.

`gpus` lists the GPUs present (1 to 8) by UUID; `on_each_gpu` runs a scenario in one fresh
process per GPU, all at once, each started with CUDA_VISIBLE_DEVICES=<its UUID> (right
whatever the runner's own CUDA_VISIBLE_DEVICES or CUDA_DEVICE_ORDER), so a test's time does
not grow with the GPU count; `hook_env` parametrizes a test over torch_memory_saver's two
hook modes, as its own tests do, giving the environment that starts a process in the mode.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest
import torch
from procenv import environ

from colocate import memory

MAX_GPUS = 8


def pytest_collection_modifyitems(config, items):
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if skip is not None:
                item.add_marker(skip)


@pytest.fixture
def gpus() -> list[str]:
    """The UUIDs ("GPU-...") of the GPUs this process sees, in torch's order (at most 8)."""
    from colocate import telemetry

    count = min(torch.cuda.device_count(), MAX_GPUS)
    return ["GPU-" + telemetry.device_uuid(i) for i in range(count)]


@pytest.fixture(params=["torch", "preload"])
def hook_env(request) -> dict[str, str]:
    """What a process needs in its environment to run in the hook mode."""
    if request.param == "torch":
        return {"COLOCATE_TMS_HOOK_MODE": "torch"}
    env = memory.preload_env()
    return {key: env[key] for key in ("LD_PRELOAD", "LD_LIBRARY_PATH", "COLOCATE_TMS_HOOK_MODE")
            if key in env}


_environ = threading.Lock()


def run_on_each_gpu(gpus: list[str], fn: Callable[..., Any], *args: Any,
                    env: dict[str, str] | None = None) -> list[Any]:
    """`fn(*args)` in one fresh process per GPU, concurrently; the results in GPU order."""
    pools, futures = [], []
    try:
        for uuid in gpus:
            child = {**(env or {}), "CUDA_VISIBLE_DEVICES": uuid}
            # a spawned worker starts at submit, with os.environ as it is then
            with _environ, environ(child):
                pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
                pools.append(pool)
                futures.append(pool.submit(fn, *args))
        return [future.result() for future in futures]
    finally:
        for pool in pools:
            pool.shutdown()


@pytest.fixture
def on_each_gpu(gpus) -> Callable[..., list[Any]]:
    return lambda fn, *args, env=None: run_on_each_gpu(gpus, fn, *args, env=env)
