"""A tag's CUDA bytes kept in pinned host memory while the tag is paused.

torch_memory_saver's own CPU backup runs at a fraction of the speed of a copy of the same
bytes to and from pinned host memory (torch_memory_saver issue #111; the figures on an
H200 and an H100: bench/RESULTS.md, "What has run on a GPU"). So the CUDA backend pauses
without it and keeps the bytes of the tag's live storages here, with asynchronous copies
filled before the pause and emptied after the resume.

The host memory is pinned when a backed-up tag gets its memory (`reserve`, called by the
CUDA backend as a region ends and at `adopt`), not at its first pause: pinning costs far
more than a copy (on an H100 the RL loop's first sync, which pinned at its first pause, took
many times as long as the later ones: bench/RESULTS.md, "What has run on a GPU"), so a pause
only copies. A tag's host memory is one chunk per growth of its live bytes (never copied
into a larger one), held for the process's life and counted as host backup bytes
(`backups.BackupCount`) from then on, exactly the bytes asked: plain host pages,
faulted in on torch's threads and then registered with CUDA (`cudaHostRegister`, as torch's
own `pinned_use_cuda_host_register` does), not torch's pinned allocator, which rounds each
block up to a power of two. A tag without backup pins nothing.

Storages of `SMALL_BYTES` or more are copied one by one: each copy moves enough bytes for
its launch not to count. Smaller ones (norms, biases, many small tensors) are gathered on
the device into a staging buffer of at most `STAGE_BYTES` with one `torch._foreach_copy_`
and cross the link in one copy (and back the same way), so their number costs a few
launches, not one each. Each storage still costs some host time a pause (a byte view of
it, its place in the layout), which overlaps with the copies in flight while a storage
takes longer to cross than that; a tag of thousands of tensors of a few KiB is bound by it
(figures: bench/RESULTS.md, "Pinned at adoption, the planned in-place sync"). The
registration and the staging have not run on a GPU: they are checked on CPU only (the
copies and their layout, with CPU storages standing in).
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from colocate.memory.backups import HOST, BackupCount
from colocate.memory.repoint import as_bytes

SMALL_BYTES = 4 << 20  # below this a storage goes through the staging buffer
STAGE_BYTES = 16 << 20  # the staging buffer's bound (within a resume's 64 MiB headroom)
CUDA_HOST_REGISTER_PORTABLE = 1


def pinned_host(nbytes: int, pin: bool = True) -> torch.Tensor:
    """`nbytes` of host memory as a uint8 tensor, page-locked for CUDA when `pin`: its
    pages faulted in first (zeroing it runs on torch's intra-op threads), then registered
    (`cudaHostRegister`); where that fails, torch's pinned allocator (which rounds up to a
    power of two). Unregistered when the tensor is collected (not at exit: the driver
    lets go of a process's pages as it ends)."""
    host = torch.empty(nbytes, dtype=torch.uint8)
    if not pin or nbytes == 0:
        return host
    host.zero_()
    cudart = torch.cuda.cudart()
    error = int(cudart.cudaHostRegister(host.data_ptr(), nbytes, CUDA_HOST_REGISTER_PORTABLE))
    if error != 0:
        _clear_last_cuda_error()
        del host
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    weakref.finalize(host, cudart.cudaHostUnregister, host.data_ptr()).atexit = False
    return host


def _clear_last_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed call, which torch's next check
    of a kernel launch (`cudaGetLastError`) would otherwise raise as its own: through the
    libcudart this process loaded, where it is a library of its own."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libcudart.so" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except (OSError, AttributeError):
        pass


@dataclass
class _Tag:
    """One tag's host memory and what it is sized for."""

    chunks: list[torch.Tensor] = field(default_factory=list)
    capacity: int = 0
    storages: dict[int, tuple[StorageWeakRef, int]] = field(default_factory=dict)

    def live_bytes(self) -> int:
        self.storages = {key: (ref, n) for key, (ref, n) in self.storages.items()
                         if not ref.expired()}
        return sum(n for _, n in self.storages.values())

    def spans(self, offset: int, size: int) -> Iterator[tuple[torch.Tensor, int, int]]:
        """The host memory of bytes [offset, offset + size) of the tag's chunks laid end to
        end: (the chunk's slice, where it starts in those bytes, its length)."""
        start = 0
        for chunk in self.chunks:
            end = start + chunk.numel()
            lo, hi = max(offset, start), min(offset + size, end)
            if lo < hi:
                yield chunk[lo - start:hi - start], lo - offset, hi - lo
            start = end
            if start >= offset + size:
                return


@dataclass
class _Layout:
    """Where a pause put each storage: those copied alone at their offsets, and the small
    ones in batches, each staged on its device and copied as one span."""

    alone: list[tuple[torch.UntypedStorage, int]]
    batches: list[tuple[int, list[torch.UntypedStorage]]]  # offset of the batch, storages
    storages: list[torch.UntypedStorage]


class PinnedBackup:
    """The backups of paused tags: `reserve` as a tag gets memory, `save` before a pause,
    `restore` after the resume."""

    def __init__(self, pin: bool = True, count: BackupCount | None = None) -> None:
        self.pin = pin  # False only where there is no CUDA to pin for (tests on CPU)
        self.count = count or BackupCount()  # the process's host backup bytes
        self.tags: dict[str, _Tag] = {}
        self.saved: dict[str, _Layout] = {}

    def _tag(self, tag: str) -> _Tag:
        return self.tags.setdefault(tag, _Tag())

    def capacity(self, tag: str) -> int:
        """Bytes of host memory the tag holds."""
        return self.tags[tag].capacity if tag in self.tags else 0

    def reserve(self, tag: str, storages: list[torch.UntypedStorage]) -> None:
        """Make the tag's host memory hold its live storages, these new ones among them:
        pinned now, so that the tag's pauses only copy."""
        record = self._tag(tag)
        for storage in storages:
            ref = StorageWeakRef(storage)
            record.storages.setdefault(ref.cdata, (ref, storage.nbytes()))
        self._grow(record, record.live_bytes())

    def _grow(self, record: _Tag, need: int) -> None:
        if need > record.capacity:
            record.chunks.append(pinned_host(need - record.capacity, self.pin))
            self.count.add(HOST, need - record.capacity)
            record.capacity = need

    def save(self, tag: str, storages: list[torch.UntypedStorage]) -> None:
        """Copy the storages' bytes into the tag's host memory (grown here if they were not
        reserved), and hold the storages until `restore` (none is freed while its tag is
        paused)."""
        record = self._tag(tag)
        layout = _layout(storages)
        self._grow(record, sum(s.nbytes() for s in storages))
        for storage, offset in layout.alone:
            whole = as_bytes(storage)
            for host, at, size in record.spans(offset, storage.nbytes()):
                host.copy_(whole[at:at + size], non_blocking=True)
        for offset, batch in layout.batches:
            with _staged(batch) as (stage, parts):
                torch._foreach_copy_(parts, [as_bytes(s) for s in batch])
                for host, at, size in record.spans(offset, stage.numel()):
                    host.copy_(stage[at:at + size], non_blocking=True)
        _wait(storages)
        self.saved[tag] = layout

    def restore(self, tag: str) -> None:
        """Copy the saved bytes back into the storages (mapped again by the resume); a
        tag saved with nothing, or not saved, has nothing to restore. On failure the
        backup stays, for a retry."""
        layout = self.saved.get(tag)
        if layout is None:
            return
        record = self.tags[tag]
        for storage, offset in layout.alone:
            whole = as_bytes(storage)
            for host, at, size in record.spans(offset, storage.nbytes()):
                whole[at:at + size].copy_(host, non_blocking=True)
        for offset, batch in layout.batches:
            with _staged(batch) as (stage, parts):
                for host, at, size in record.spans(offset, stage.numel()):
                    stage[at:at + size].copy_(host, non_blocking=True)
                torch._foreach_copy_([as_bytes(s) for s in batch], parts)
        _wait(layout.storages)
        del self.saved[tag]

    def drop(self, tag: str) -> None:
        """Forget the tag's saved storages (its pause did not happen); its memory stays."""
        self.saved.pop(tag, None)


def _layout(storages: list[torch.UntypedStorage]) -> _Layout:
    """The storages packed end to end: first each of `SMALL_BYTES` or more, in order, then
    the small ones in batches of at most `STAGE_BYTES`, a batch per device."""
    alone, offset = [], 0
    small: dict[torch.device, list[torch.UntypedStorage]] = {}
    for storage in storages:
        if storage.nbytes() >= SMALL_BYTES:
            alone.append((storage, offset))
            offset += storage.nbytes()
        elif storage.nbytes():
            small.setdefault(storage.device, []).append(storage)
    batches: list[tuple[int, list[torch.UntypedStorage]]] = []
    for group in small.values():
        batch: list[torch.UntypedStorage] = []
        size = 0
        for storage in group:
            if batch and size + storage.nbytes() > STAGE_BYTES:
                batches.append((offset, batch))
                offset += size
                batch, size = [], 0
            batch.append(storage)
            size += storage.nbytes()
        if batch:
            batches.append((offset, batch))
            offset += size
    return _Layout(alone, batches, list(storages))


@contextmanager
def _staged(batch: list[torch.UntypedStorage]
            ) -> Iterator[tuple[torch.Tensor, list[torch.Tensor]]]:
    """A staging buffer on the batch's device holding the batch end to end, and its parts
    (one per storage). It goes back to the allocator after the block, with copies from or
    into it maybe still queued: the stream's order keeps them before any reuse."""
    sizes = [s.nbytes() for s in batch]
    stage = torch.empty(sum(sizes), dtype=torch.uint8, device=batch[0].device)
    yield stage, list(stage.split(sizes))


def _wait(storages: list[torch.UntypedStorage]) -> None:
    """Wait for the copies on each CUDA device the storages are on."""
    for index in {s.device.index for s in storages if s.device.type == "cuda"}:
        torch.cuda.synchronize(index)
