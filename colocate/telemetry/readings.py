"""Point-in-time memory readings: this process's host memory, or a GPU's used memory via NVML.

A GPU reading is device-wide (every process on the GPU: `scope="device"`) unless it says
`scope="process"`: `read_gpu_process` gives this process's own share where NVML's
per-process accounting has it, and falls back to the device-wide reading otherwise (a
container that hides host pids, a driver or MIG instance that does not report it). A
device-wide reading counts other processes' memory too: compare two of them only with a
tolerance for what those may allocate or free meanwhile (`DEVICE_WIDE_TOLERANCE_BYTES`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from colocate.telemetry.nvml import NvmlError, nvml


class TelemetryError(RuntimeError):
    """A memory reading could not be taken (no NVML, no CUDA device, unknown device)."""


@dataclass(frozen=True)
class MemoryReading:
    """Memory in use on `device` ("cpu" or "cuda:<torch index>") at `timestamp` (time.time()).

    For "cpu" `used_bytes` is this process's RSS and `uss_bytes` its unique set size when asked
    for; for a GPU it is the memory used on the whole device, by every process
    (`scope="device"`), or by this process alone (`scope="process"`).
    """

    device: str
    used_bytes: int
    timestamp: float
    uss_bytes: int | None = None
    total_bytes: int | None = None  # a GPU's capacity
    scope: str = "process"  # "process": this process's own memory; "device": all processes


# What other processes may allocate or free on a GPU between two device-wide readings of a
# switch, allowed for when a release is checked without per-process accounting: their CUDA
# contexts and caching allocators move in steps of tens of MiB (2 MiB pages, 20 MiB blocks).
DEVICE_WIDE_TOLERANCE_BYTES = 256 << 20


_process_cache: tuple[int, psutil.Process] | None = None


def _process() -> psutil.Process:
    """This process's psutil handle, remade after a fork (a handle keeps its pid)."""
    global _process_cache
    pid = os.getpid()
    cached = _process_cache
    if cached is None or cached[0] != pid:
        cached = _process_cache = (pid, psutil.Process(pid))
    return cached[1]


_statm: tuple[int, int] | None = None  # (pid, an open descriptor of its /proc/<pid>/statm)
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def process_rss() -> int:
    """This process's resident set size in bytes, for hot paths (a switch reads it 20-40
    times): one `pread` of /proc/<pid>/statm, kept open (about 3 us, where psutil's
    `memory_info` opens, reads and closes it in about 30 us). Reopened after a fork."""
    global _statm
    pid = os.getpid()
    if _statm is None or _statm[0] != pid:
        if _statm is not None:
            os.close(_statm[1])  # the parent's, inherited through a fork
        _statm = (pid, os.open(f"/proc/{pid}/statm", os.O_RDONLY | os.O_CLOEXEC))
    return int(os.pread(_statm[1], 128, 0).split()[1]) * PAGE_SIZE


def read_cpu(include_uss: bool = False) -> MemoryReading:
    """This process's RSS; with `include_uss` also its USS (slower: it walks the memory maps)."""
    if include_uss:
        info = _process().memory_full_info()
        return MemoryReading("cpu", info.rss, time.time(), uss_bytes=info.uss)
    return MemoryReading("cpu", process_rss(), time.time())


_others: dict[int, psutil.Process] = {}


def read_pid(pid: int) -> MemoryReading:
    """The RSS of another process of this host (how an arbiter measures a CPU slot)."""
    try:
        process = _others.get(pid) or _others.setdefault(pid, psutil.Process(pid))
        rss = process.memory_info().rss
    except psutil.Error as e:
        raise TelemetryError(f"cannot read memory of process {pid}: {e}") from e
    return MemoryReading(f"pid:{pid}", rss, time.time())


PF_EXITING = 0x4  # Linux task flag: the process has begun to exit (its memory is going)


def process_runs(pid: int) -> bool:
    """Whether process `pid` of this host still runs: not gone, not a zombie, and (where
    /proc tells) not in its exit, when its memory already reads as released. On Linux one
    read of /proc/<pid>/stat (~30 us; psutil's status() took ~115, and the arbiter asks
    at every call it watches)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()  # after comm, which may hold ")"
        state, flags = fields[0], int(fields[6])  # fields 3 and 9 of proc(5)
    except FileNotFoundError:  # gone, or no /proc on this system
        return not os.path.isdir("/proc/self") and _runs_by_psutil(pid)
    except (OSError, ValueError, IndexError):  # not ours to read, or going right now
        return _runs_by_psutil(pid)
    return state not in (b"Z", b"X", b"x") and not flags & PF_EXITING


def _runs_by_psutil(pid: int) -> bool:
    """`process_runs` where there is no /proc (macOS): alive and not a zombie."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # it exists, but we may not look at it
        return True


_handles: dict[str, Any] = {}  # bare device UUID -> NVML device handle


def _nvml() -> Any:
    """pynvml, initialised (`colocate.telemetry.nvml`); TelemetryError where it cannot be."""
    try:
        lib = nvml()
    except NvmlError as e:
        raise TelemetryError(
            f"cannot read GPU memory: {e}; check that the NVIDIA driver is installed and "
            "loaded (`nvidia-smi` must work here)") from e
    if lib is None:
        raise TelemetryError(
            "cannot read GPU memory: NVML is not available here: install its bindings, the "
            "nvidia-ml-py package (`pip install nvidia-ml-py`), and check that the NVIDIA "
            "driver is loaded (`nvidia-smi` must work)")
    return lib


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
    lib = _nvml()
    # NVML names a full GPU "GPU-<uuid>" and a MIG instance "MIG-<uuid>"; torch gives neither.
    for prefix in ("GPU-", "MIG-"):
        try:
            handle = lib.nvmlDeviceGetHandleByUUID(prefix + uuid)
        except lib.NVMLError:
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
    info = _nvml().nvmlDeviceGetMemoryInfo(handle)
    return MemoryReading(label or f"gpu:{uuid}", int(info.used), time.time(),
                         total_bytes=int(info.total), scope="device")


def process_share(entries: list[Any], pid: int) -> int | None:
    """`pid`'s bytes among NVML's per-process entries of a device (objects with `pid` and
    `usedGpuMemory`, as nvmlDeviceGetComputeRunningProcesses returns them), or None when
    NVML does not say: no entry for the pid (another pid namespace, no CUDA context yet) or
    the amount is not available (pynvml gives None)."""
    amounts = [e.usedGpuMemory for e in entries if e.pid == pid]
    if not amounts or any(a is None for a in amounts):
        return None
    return sum(int(a) for a in amounts)


def read_gpu_process(index: int = 0, pid: int | None = None) -> MemoryReading:
    """This process's (or `pid`'s) memory on torch's cuda:<index> (`scope="process"`), from
    NVML's per-process accounting; the device-wide reading (`scope="device"`) where NVML
    does not give it (see `process_share`)."""
    return read_gpu_uuid_process(device_uuid(index), os.getpid() if pid is None else pid,
                                 label=f"cuda:{index}")


def read_gpu_uuid_process(uuid: str, pid: int, label: str | None = None) -> MemoryReading:
    """`pid`'s memory on the GPU with this UUID (`scope="process"`), or the device-wide
    reading (`scope="device"`) where NVML does not give it; from any process of the host
    (how an arbiter can measure a tenant's release without counting other processes)."""
    reading = read_gpu_uuid(uuid, label=label)
    lib = _nvml()
    try:
        entries = lib.nvmlDeviceGetComputeRunningProcesses(
            _handle(uuid.removeprefix("GPU-").removeprefix("MIG-")))
    except lib.NVMLError:
        return reading
    share = process_share(entries, pid)
    if share is None:
        return reading
    return MemoryReading(reading.device, share, time.time(), total_bytes=reading.total_bytes,
                         scope="process")


def read_gpu(index: int = 0) -> MemoryReading:
    """Memory used on torch's cuda:<index> (all processes: `scope="device"`), found by UUID
    so that indices remapped by CUDA_VISIBLE_DEVICES stay right."""
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
