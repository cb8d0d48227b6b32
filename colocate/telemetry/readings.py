"""Point-in-time memory readings: this process's host memory, or a GPU's used memory via NVML."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import psutil
import torch


class TelemetryError(RuntimeError):
    """A memory reading could not be taken (no NVML, no CUDA device, unknown device)."""


@dataclass(frozen=True)
class MemoryReading:
    """Memory in use on `device` ("cpu" or "cuda:<torch index>") at `timestamp` (time.time()).

    For "cpu" `used_bytes` is this process's RSS and `uss_bytes` its unique set size when asked
    for; for "cuda:<i>" it is the memory used on the whole device, by every process.
    """

    device: str
    used_bytes: int
    timestamp: float
    uss_bytes: int | None = None
    total_bytes: int | None = None  # a GPU's capacity


_process_cache: tuple[int, psutil.Process] | None = None


def _process() -> psutil.Process:
    """This process's psutil handle, remade after a fork (a handle keeps its pid)."""
    global _process_cache
    pid = os.getpid()
    cached = _process_cache
    if cached is None or cached[0] != pid:
        cached = _process_cache = (pid, psutil.Process(pid))
    return cached[1]


def process_rss() -> int:
    """This process's resident set size in bytes (one cheap system call, for hot paths)."""
    return _process().memory_info().rss


def read_cpu(include_uss: bool = False) -> MemoryReading:
    """This process's RSS; with `include_uss` also its USS (slower: it walks the memory maps)."""
    process = _process()
    if include_uss:
        info = process.memory_full_info()
        return MemoryReading("cpu", info.rss, time.time(), uss_bytes=info.uss)
    return MemoryReading("cpu", process.memory_info().rss, time.time())


_others: dict[int, psutil.Process] = {}


def read_pid(pid: int) -> MemoryReading:
    """The RSS of another process of this host (how an arbiter measures a CPU slot)."""
    try:
        process = _others.get(pid) or _others.setdefault(pid, psutil.Process(pid))
        rss = process.memory_info().rss
    except psutil.Error as e:
        raise TelemetryError(f"cannot read memory of process {pid}: {e}") from e
    return MemoryReading(f"pid:{pid}", rss, time.time())


_nvml_lock = threading.Lock()
_nvml: Any = None  # the pynvml module, once nvmlInit() has succeeded
_handles: dict[str, Any] = {}  # bare device UUID -> NVML device handle


def _init_nvml() -> Any:
    """Import pynvml and run nvmlInit() once per process; TelemetryError when that fails."""
    global _nvml
    with _nvml_lock:
        if _nvml is None:
            try:
                import pynvml
            except ImportError as e:
                raise TelemetryError(
                    f"cannot read GPU memory: the NVML bindings are missing ({e}); "
                    "install the nvidia-ml-py package (`pip install nvidia-ml-py`)"
                ) from e
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError as e:
                raise TelemetryError(
                    f"cannot read GPU memory: NVML failed to initialize ({e}); check that the "
                    "NVIDIA driver is installed and loaded (`nvidia-smi` must work here)"
                ) from e
            _nvml = pynvml
        return _nvml


def device_uuid(index: int) -> str:
    """The bare UUID ("xxxxxxxx-xxxx-...") of torch's cuda:<index>, after any remapping."""
    if not torch.cuda.is_available():
        raise TelemetryError(
            f"cannot read memory of cuda:{index}: torch sees no CUDA device "
            "(CPU-only torch build, no driver, or CUDA_VISIBLE_DEVICES hides every GPU)"
        )
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise TelemetryError(
            f"cannot read memory of cuda:{index}: this process sees {count} CUDA device(s)"
        )
    return str(torch.cuda.get_device_properties(index).uuid).removeprefix("GPU-")


def _handle(uuid: str) -> Any:
    """The NVML handle of the device with this bare UUID."""
    handle = _handles.get(uuid)
    if handle is not None:
        return handle
    nvml = _init_nvml()
    # NVML names a full GPU "GPU-<uuid>" and a MIG instance "MIG-<uuid>"; torch gives neither.
    for prefix in ("GPU-", "MIG-"):
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(prefix + uuid)
        except nvml.NVMLError:
            continue
        _handles[uuid] = handle
        return handle
    raise TelemetryError(
        f"cannot read memory of GPU {uuid}: NVML knows no device with that UUID; "
        "check that torch and NVML see the same driver (`nvidia-smi -L` lists the UUIDs)"
    )


def read_gpu_uuid(uuid: str, label: str | None = None) -> MemoryReading:
    """Memory used (all processes) and total on the GPU with this UUID, as NVML reports it.

    Works from any process of the host, whatever its CUDA_VISIBLE_DEVICES.
    """
    handle = _handle(uuid.removeprefix("GPU-").removeprefix("MIG-"))
    info = _nvml.nvmlDeviceGetMemoryInfo(handle)
    return MemoryReading(label or f"gpu:{uuid}", int(info.used), time.time(),
                         total_bytes=int(info.total))


def read_gpu(index: int = 0) -> MemoryReading:
    """Memory used on torch's cuda:<index> (all processes), found by UUID so that indices
    remapped by CUDA_VISIBLE_DEVICES stay right."""
    return read_gpu_uuid(device_uuid(index), label=f"cuda:{index}")


def read(device: str | torch.device) -> MemoryReading:
    """A reading of "cpu" (this process's RSS) or "cuda[:i]" (the device's used memory)."""
    device = torch.device(device)
    if device.type == "cpu":
        return read_cpu()
    if device.type == "cuda":
        if device.index is not None:
            return read_gpu(device.index)
        if not torch.cuda.is_available():
            raise TelemetryError("cannot read memory of cuda: torch sees no CUDA device")
        return read_gpu(torch.cuda.current_device())
    raise ValueError(f"no memory reading for device {str(device)!r}; use 'cpu' or 'cuda[:i]'")
