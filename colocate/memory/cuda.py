"""CUDA backend: torch_memory_saver regions, paused and resumed per tag.

Hook mode: `COLOCATE_TMS_HOOK_MODE`, "torch" by default. "torch" routes the allocations
of a region through a pluggable-allocator memory pool and needs no special start.
"preload" intercepts cudaMalloc itself (needed for pauseable CUDA graphs) and needs the
hook library in `LD_PRELOAD` before the process starts: start it with the environment
from `preload_env()` (Monarch procs get it through their bootstrap command).

torch_memory_saver calls exit(1) on a bad transition; the registry checks every
transition before it reaches this module.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import AbstractContextManager

import torch

from colocate.memory.errors import CudaSetupError

HOOK_MODE_ENV = "COLOCATE_TMS_HOOK_MODE"
HOOK_MODES = ("torch", "preload")


def check_allocator_conf(env: Mapping[str, str]) -> None:
    """Refuse `expandable_segments:True`, which torch_memory_saver cannot pause."""
    conf = env.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments:True" in conf:
        raise CudaSetupError(
            f"PYTORCH_CUDA_ALLOC_CONF={conf!r} enables expandable segments, whose memory "
            "torch_memory_saver cannot pause or resume. Remove 'expandable_segments:True' "
            "(or set 'expandable_segments:False') before the process starts."
        )


def _preload_library() -> str:
    from torch_memory_saver.utils import get_binary_path_from_package

    return str(get_binary_path_from_package("torch_memory_saver_hook_mode_preload"))


def preload_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of `env` (default: os.environ) set up to start a process in "preload" mode."""
    env = dict(os.environ if env is None else env)
    current = env.get("LD_PRELOAD", "")
    env["LD_PRELOAD"] = f"{_preload_library()}:{current}" if current else _preload_library()
    env[HOOK_MODE_ENV] = "preload"
    return env


def hook_mode(env: Mapping[str, str]) -> str:
    """The hook mode that `env` asks for, checked against how the process was started."""
    mode = env.get(HOOK_MODE_ENV, "torch")
    if mode not in HOOK_MODES:
        raise CudaSetupError(f"{HOOK_MODE_ENV}={mode!r}: use one of {HOOK_MODES}.")
    if mode == "preload" and "torch_memory_saver" not in env.get("LD_PRELOAD", ""):
        raise CudaSetupError(
            f"{HOOK_MODE_ENV}=preload needs torch_memory_saver's hook library in LD_PRELOAD "
            "before the process starts, and LD_PRELOAD does not name it. Start the process "
            "with the environment from colocate.memory.preload_env(), or use hook mode "
            "'torch', which needs no special start."
        )
    return mode


class CudaBackend:
    """Tags on CUDA memory, through the process-wide torch_memory_saver singleton."""

    device_type = "cuda"

    def __init__(self) -> None:
        check_allocator_conf(os.environ)
        mode = hook_mode(os.environ)
        if not torch.cuda.is_available():
            raise CudaSetupError("CUDA memory was tagged, but torch sees no CUDA device.")
        from torch_memory_saver import torch_memory_saver

        torch_memory_saver.hook_mode = mode
        self.saver = torch_memory_saver

    def region(self, tag: str, backup: bool) -> AbstractContextManager[None]:
        return self.saver.region(tag=tag, enable_cpu_backup=backup)

    def claim(self, tag: str, storages: list[torch.UntypedStorage], backup: bool) -> None:
        """Region allocations already live in torch_memory_saver's memory."""

    def adopt(self, tag: str, storages: list[torch.UntypedStorage], backup: bool) -> None:
        with self.region(tag, backup):
            for storage in storages:
                target = torch.empty(storage.nbytes(), dtype=torch.uint8, device=storage.device)
                target.copy_(torch.empty(0, dtype=torch.uint8, device=storage.device)
                             .set_(storage))
                storage._swap_data_ptr_(target.untyped_storage())
                del target
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def pause(self, tag: str, backup: bool) -> None:
        torch.cuda.synchronize()
        self.saver.pause(tag)

    def resume(self, tag: str) -> None:
        self.saver.resume(tag)
