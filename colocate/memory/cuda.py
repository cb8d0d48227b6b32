"""CUDA backend: torch_memory_saver regions, paused and resumed per tag.

Hook mode: `COLOCATE_TMS_HOOK_MODE`, "torch" by default. "torch" routes the allocations
of a region through a pluggable-allocator memory pool and needs no special start.
"preload" intercepts cudaMalloc itself (needed for pauseable CUDA graphs) and needs the
hook library in `LD_PRELOAD` before the process starts, and torch's CUDA runtime on
`LD_LIBRARY_PATH` so that the loader can load it: start the process with the environment
from `preload_env()` (Monarch procs of a GPU slot get it through their bootstrap command
when the client runs in preload mode). The backend checks at start that cudaMalloc
really resolves to the hook.

torch_memory_saver calls exit(1) on a bad transition, on an out-of-memory resume and when
it frees memory outside a region. The registry checks every transition first; this
module checks free device memory before a resume, keeps the memory pools alive at exit,
and warms cuBLAS before the first region. A backed-up tag's bytes are kept in pinned host
memory (`pinned.PinnedBackup`), not by torch_memory_saver's own CPU backup, which runs at a
fraction of a pinned copy's speed (torch_memory_saver issue #111; figures: bench/RESULTS.md,
"What has run on a GPU"); that memory is pinned as the tag gets its CUDA memory (a region's
end, `adopt`), so that a pause only copies.

A tag's CUDA memory lives on the device that was current when it got it: torch_memory_saver
tags only the current device's allocations (in torch mode its memory pool is per device),
so the registry refuses memory on another device.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import warnings
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path

import torch

from colocate.memory.backups import DISK, HOST, BackupCount
from colocate.memory.errors import CudaSetupError, ResumeOutOfMemoryError, TaggedMemoryError
from colocate.memory.pinned import PinnedBackup
from colocate.memory.repoint import Held, move

HOOK_MODE_ENV = "COLOCATE_TMS_HOOK_MODE"
HOOK_MODES = ("torch", "preload")
PRELOAD_LIBRARY = "torch_memory_saver_hook_mode_preload"
# What a resume may need beyond the tag's bytes: cuMemCreate rounds each allocation up to
# the 2 MiB granularity, and the driver may grow the context.
RESUME_HEADROOM_BYTES = 64 << 20
MIB = 1 << 20

# -- set-up checks ---------------------------------------------------------------------


def check_allocator_conf(env: Mapping[str, str]) -> None:
    """Refuse `expandable_segments:True`, which torch_memory_saver cannot pause, in either
    variable torch reads (`PYTORCH_ALLOC_CONF`, and the older `PYTORCH_CUDA_ALLOC_CONF`)."""
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        conf = env.get(name, "")
        for option in conf.split(","):
            key, _, value = option.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                raise CudaSetupError(
                    f"{name}={conf!r} enables expandable segments, whose memory "
                    "torch_memory_saver cannot pause or resume. Remove "
                    "'expandable_segments:True' (or set 'expandable_segments:False') "
                    "before the process starts."
                )


def _preload_library() -> str:
    from torch_memory_saver.utils import get_binary_path_from_package

    return str(get_binary_path_from_package(PRELOAD_LIBRARY))


def cuda_library_dirs(site: Path | None = None) -> list[str]:
    """torch's own CUDA libraries: the `nvidia/cu*/lib` directories beside torch in `site`
    (default: torch's site-packages; the CUDA wheels' libcudart, cuBLAS...); none with a
    CPU-only torch."""
    site = site or Path(torch.__file__).resolve().parent.parent
    return [str(d) for d in sorted(site.glob("nvidia/cu*/lib")) if d.is_dir()]


def _prepend(path: str, first: list[str]) -> str:
    rest = [p for p in path.split(":") if p and p not in first]
    return ":".join(first + rest)


def preload_env(env: Mapping[str, str] | None = None,
                library_dirs: list[str] | None = None) -> dict[str, str]:
    """A copy of `env` (default: os.environ) set up to start a process in "preload" mode:
    the hook library in `LD_PRELOAD`, torch's CUDA libraries (`library_dirs`, default
    `cuda_library_dirs()`: the hook library links against their libcudart) first on
    `LD_LIBRARY_PATH`, and the hook mode."""
    env = dict(os.environ if env is None else env)
    env["LD_PRELOAD"] = _prepend(env.get("LD_PRELOAD", ""), [_preload_library()])
    dirs = cuda_library_dirs() if library_dirs is None else library_dirs
    if dirs:
        env["LD_LIBRARY_PATH"] = _prepend(env.get("LD_LIBRARY_PATH", ""), dirs)
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


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def symbol_owner(name: str) -> str | None:
    """The file of the library whose `name` this process's global symbol lookup finds (the
    one calls from other libraries reach), or None when no loaded library defines it."""
    try:
        address = ctypes.cast(getattr(ctypes.CDLL(None), name), ctypes.c_void_p).value
    except AttributeError:
        return None
    info = _DlInfo()
    try:
        dladdr = ctypes.CDLL(None).dladdr
    except AttributeError:  # glibc < 2.34 keeps it in libdl
        dladdr = ctypes.CDLL("libdl.so.2").dladdr
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    if not dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.fsdecode(info.dli_fname)


def cuda_malloc_owner() -> str | None:
    """The library whose cudaMalloc torch's calls reach: the hook's in "preload" mode."""
    return symbol_owner("cudaMalloc")


def check_preload_hook(owner: str | None) -> None:
    """Refuse "preload" mode when cudaMalloc (found in `owner`, see `cuda_malloc_owner`)
    is not torch_memory_saver's hook: then nothing is intercepted and a pause frees
    nothing. The loader only warns when it cannot preload a library."""
    if owner is not None and PRELOAD_LIBRARY in os.path.basename(owner):
        return
    found = f"resolves to {owner}" if owner else "is defined by no loaded library"
    raise CudaSetupError(
        f"{HOOK_MODE_ENV}=preload, but cudaMalloc {found}, not torch_memory_saver's hook, "
        "so a pause would free nothing. The loader skipped LD_PRELOAD (it says 'cannot be "
        "preloaded' on stderr), most often because the hook library did not find "
        "libcudart. Start the process with the environment from "
        "colocate.memory.preload_env(), which also puts torch's nvidia/cu*/lib on "
        "LD_LIBRARY_PATH, or use hook mode 'torch'."
    )


def check_resume_fits(tag: str, need_bytes: int, free_bytes: int, device: int) -> None:
    """Raise `ResumeOutOfMemoryError` unless `free_bytes` on cuda:`device` hold the tag's
    `need_bytes` plus headroom: torch_memory_saver ends the process on an out-of-memory
    resume, where this error leaves the tag paused and the resume retryable."""
    if need_bytes + RESUME_HEADROOM_BYTES <= free_bytes:
        return
    raise ResumeOutOfMemoryError(
        f"resume({tag!r}) needs {need_bytes / MIB:.0f} MiB on cuda:{device} (plus "
        f"{RESUME_HEADROOM_BYTES // MIB} MiB headroom), and the device has "
        f"{free_bytes / MIB:.0f} MiB free; torch_memory_saver would end the process "
        f"(exit(1)) on that out-of-memory. Free memory on cuda:{device} (pause another tag, "
        f"or let the other processes on it release theirs), then call resume({tag!r}) "
        "again: the tag stays paused."
    )


# -- process-wide fixes, run once when the backend starts --------------------------------


def warm_libraries(device: torch.device) -> None:
    """Make cuBLAS/cuBLASLt create their handles and workspaces, and cuDNN its handle, now,
    outside any region. Torch allocates a cuBLAS workspace per (handle, stream) from the
    caching allocator at the first matmul and keeps it: made inside a region it would
    belong to the tag and be paused with it, and later matmuls would fault on it. Matmuls
    on another stream get their own workspace: make them outside regions first too."""
    a = torch.ones(16, 16, device=device)
    a @ a
    dtypes = [torch.float16] + ([torch.bfloat16] if torch.cuda.is_bf16_supported() else [])
    for dtype in dtypes:  # addmm with a bias goes through cuBLASLt
        h = a.to(dtype)
        torch.nn.functional.linear(h, h, h[0])
    if torch.backends.cudnn.is_available():
        torch.nn.functional.conv2d(a.view(1, 1, 16, 16), a[:3, :3].reshape(1, 1, 3, 3))
    torch.cuda.synchronize(device)


def keep_alive_at_exit(pools: Callable[[], list[object]]) -> None:
    """At interpreter exit, take a reference to each object `pools()` returns that nothing
    gives back, so that finalization never destroys them.

    torch_memory_saver keeps one torch MemPool per tag (entrypoint.py `_mem_pools`, which it
    clears at exit on ROCm/XPU only). A MemPool's destructor empties its cache through the
    pool's allocator, i.e. `tms_torch_free`, outside any region, which fails its
    `is_interesting_region` check (csrc/entrypoint.cpp) and exits with status 1; a paused
    allocation freed there fails cuMemUnmap the same way. The driver frees everything when
    the process ends, so leaving the pools alive costs nothing.
    """

    def keep() -> None:
        for pool in pools():
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(pool))

    atexit.register(keep)


def _saver_pools(saver: object) -> list[object]:
    impl = getattr(saver, "_impl", None)
    return list(getattr(impl, "_mem_pools", {}).values())


def device_free_bytes(device: int) -> int:
    return int(torch.cuda.mem_get_info(device)[0])


class CudaBackend:
    """Tags on CUDA memory, through the process-wide torch_memory_saver singleton."""

    device_type = "cuda"

    def __init__(self, count: BackupCount | None = None) -> None:
        check_allocator_conf(os.environ)
        mode = hook_mode(os.environ)
        if not torch.cuda.is_available():
            raise CudaSetupError("CUDA memory was tagged, but torch sees no CUDA device.")
        if mode == "preload":
            check_preload_hook(cuda_malloc_owner())
        from torch_memory_saver import torch_memory_saver

        torch_memory_saver.hook_mode = mode
        self.saver = torch_memory_saver
        warm_libraries(torch.device("cuda", torch.cuda.current_device()))
        keep_alive_at_exit(lambda: _saver_pools(self.saver))
        self.free_bytes: Callable[[int], int] = device_free_bytes
        self.backup = PinnedBackup(count=count)

    def region(self, tag: str, backup: bool) -> AbstractContextManager[None]:
        """torch_memory_saver's region, without its CPU backup: a backed-up tag's bytes go
        to pinned memory at the pause (`PinnedBackup`), 10-20x faster."""
        return self.saver.region(tag=tag, enable_cpu_backup=False)

    def claim(self, tag: str, storages: list[torch.UntypedStorage],
              backup: bool) -> list[torch.UntypedStorage]:
        """Region allocations already live in torch_memory_saver's memory; a backed-up
        tag's host memory is pinned for them now (`PinnedBackup.reserve`)."""
        if backup:
            self._reserve(tag, storages)
        return storages

    def adopt(self, tag: str, held: list[Held], backup: bool) -> list[torch.UntypedStorage]:
        moved = []
        with self.region(tag, backup):
            for h in held:
                target = torch.empty(h.storage.nbytes(), dtype=torch.uint8,
                                     device=h.storage.device)
                moved.append(move(h, target.untyped_storage()))
                del target
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        if backup:  # pinned now, not at the first pause
            self._reserve(tag, moved)
        return moved

    def _reserve(self, tag: str, storages: list[torch.UntypedStorage]) -> None:
        """Pin the host memory of a backed-up tag's new storages. It never fails the
        region or the adoption (whose storages the registry must still track): where
        pinning fails now, the pause pins what is missing, or fails, rolled back."""
        try:
            self.backup.reserve(tag, storages)
        except Exception as err:
            warnings.warn(f"tag {tag!r}: could not pin {sum(s.nbytes() for s in storages)} "
                          f"bytes of host memory for its backup now ({err}); its next "
                          "pause pins them", RuntimeWarning, stacklevel=3)

    def pause(self, tag: str, place: str, device: int,
              storages: list[torch.UntypedStorage]) -> None:
        """To `HOST`, the live storages' bytes go to pinned memory first; then
        torch_memory_saver unmaps the tag's memory. A CUDA tag's backup to disk is not
        built: refused before anything moves."""
        if place == DISK:
            raise TaggedMemoryError(
                f"pause({tag!r}) to disk: a CUDA tag's backup to disk is not built yet; give "
                "the host more memory for backups (run.host_memory) or let fewer stages "
                "sleep (more slot memory)")
        torch.cuda.synchronize()
        if place == HOST:
            self.backup.save(tag, storages)
        try:
            self.saver.pause(tag)
        except BaseException:
            self.backup.drop(tag)
            raise

    def resume(self, tag: str, nbytes: int, device: int) -> None:
        """Resume after checking that the tag fits on the device: its live bytes, or its
        memory pools' segments when torch reports them (whole allocations, with the pool
        blocks not in use, which torch_memory_saver maps back too); then the backed-up
        bytes go back. Should that copy fail, the tag is paused again, so the resume can
        be retried."""
        need = max(nbytes, _pool_bytes(self.saver, tag) or 0)
        check_resume_fits(tag, need, self.free_bytes(device), device)
        self.saver.resume(tag)
        try:
            self.backup.restore(tag)
        except BaseException:
            self.saver.pause(tag)
            raise


def _pool_bytes(saver: object, tag: str) -> int | None:
    """The bytes of the segments in torch_memory_saver's memory pools of `tag` (its
    entrypoint.py keys `_mem_pools` by (tag, ...)); None where that cannot be read."""
    pools = getattr(getattr(saver, "_impl", None), "_mem_pools", None)
    if pools is None:
        return None
    try:
        return sum(int(segment["total_size"]) for key, pool in list(pools.items())
                   if key[0] == tag for segment in pool.snapshot())
    except Exception:  # another torch_memory_saver or torch layout: fall back to live bytes
        return None
