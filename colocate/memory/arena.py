"""CPU backend: an mmap arena per tag whose pages go back to the OS on pause.

`adopt` copies each storage into an anonymous private mapping and re-points the storage's
tensors to it (`colocate.memory.repoint`: a data-pointer swap, so every view follows, or
on torch 2.11 `Tensor.set_` on each tensor found). `pause` writes the
mappings to an unlinked backup file when the tag has backup, then `MADV_DONTNEED`s them:
RSS drops at once. `resume` reads the file back into the same addresses, or, without
backup, faults in zeroed pages, so `data_ptr()` is the same before and after.

The backup file lives in `$COLOCATE_BACKUP_DIR` (default: the system temp dir). Put it on
a disk, not tmpfs, or the paused bytes stay in RAM.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import weakref
from contextlib import AbstractContextManager, nullcontext
from typing import BinaryIO

import torch

from colocate.memory.errors import TaggedMemoryError
from colocate.memory.repoint import Held, mode, move

HUGE_PAGE = 2 << 20
ALIGN = 64
MADV_POPULATE_WRITE = 23  # Linux 5.14+; not exported by the mmap module


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


class Chunk(mmap.mmap):
    """One anonymous private mapping holding storages of one tag.

    The storages keep it alive through the buffers they were built on; the arena only
    holds weak references, so a chunk is unmapped when its last storage is freed.

    The mapping is rounded up to a huge page; only its first `used` bytes hold storages,
    and a backup saves and restores only those: for a small tag (a tiny model's weights,
    a few hundred KiB) writing the padding too made the backup most of a pause's time.
    """

    used: int

    @classmethod
    def allocate(cls, nbytes: int) -> Chunk:
        chunk = cls(-1, _round_up(max(nbytes, 1), HUGE_PAGE),
                    flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        chunk.madvise(mmap.MADV_HUGEPAGE)
        chunk.used = nbytes
        return chunk

    def release(self) -> None:
        self.madvise(mmap.MADV_DONTNEED)

    def populate(self) -> None:
        # the whole mapping: one fault of a huge page costs less than one per small page
        self.madvise(MADV_POPULATE_WRITE)


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _read_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        got = os.preadv(fd, [view], offset)
        if got == 0:
            raise OSError(f"backup file ended early at offset {offset}")
        view, offset = view[got:], offset + got


class TagArena:
    """The chunks of one tag and, while it is paused with backup, their backup file."""

    def __init__(self, backup_dir: str) -> None:
        self.backup_dir = backup_dir
        self.chunks: list[weakref.ref[Chunk]] = []
        self.backup: BinaryIO | None = None

    def live_chunks(self) -> list[Chunk]:
        live = [chunk for chunk in (ref() for ref in self.chunks) if chunk is not None]
        self.chunks = [weakref.ref(chunk) for chunk in live]
        return live

    def adopt(self, held: list[Held]) -> list[torch.UntypedStorage]:
        """Move the storages into one new chunk, keeping their contents; returns the
        storages that hold them now."""
        offsets, end = [], 0
        for h in held:
            offsets.append(end)
            end = _round_up(end + h.storage.nbytes(), ALIGN)
        chunk = Chunk.allocate(end)
        whole = memoryview(chunk)
        moved = []
        for h, offset in zip(held, offsets, strict=True):
            nbytes = h.storage.nbytes()
            target = torch.frombuffer(whole[offset:offset + nbytes], dtype=torch.uint8)
            moved.append(move(h, target.untyped_storage()))
            del target
        whole.release()
        self.chunks.append(weakref.ref(chunk))
        return moved

    def pause(self, backup: bool) -> None:
        chunks = self.live_chunks()
        if backup:
            self._save(chunks)
        for chunk in chunks:
            chunk.release()

    def _save(self, chunks: list[Chunk]) -> None:
        """Write every chunk to a new backup file; on failure nothing is released."""
        backup = tempfile.TemporaryFile(dir=self.backup_dir)
        try:
            offset = 0
            for chunk in chunks:
                with memoryview(chunk) as view:
                    _write_all(backup.fileno(), view[:chunk.used], offset)
                offset += chunk.used
        except BaseException:
            backup.close()
            raise
        self.backup = backup

    def resume(self) -> None:
        chunks = self.live_chunks()
        if self.backup is None:
            for chunk in chunks:
                chunk.populate()
            return
        offset = 0
        for chunk in chunks:
            with memoryview(chunk) as view:
                _read_all(self.backup.fileno(), view[:chunk.used], offset)
            offset += chunk.used
        self.backup.close()
        self.backup = None


class ArenaBackend:
    """The CPU backend: one `TagArena` per tag."""

    device_type = "cpu"

    def __init__(self, backup_dir: str | None = None) -> None:
        self.backup_dir = backup_dir or os.environ.get("COLOCATE_BACKUP_DIR") \
            or tempfile.gettempdir()
        self.arenas: dict[str, TagArena] = {}

    def _arena(self, tag: str) -> TagArena:
        return self.arenas.setdefault(tag, TagArena(self.backup_dir))

    def region(self, tag: str, backup: bool) -> AbstractContextManager[None]:
        if mode() != "swap":
            raise TaggedMemoryError(
                f"region({tag!r}) on CPU moves what the block allocated into the arena by "
                "swapping storages' data pointers, which needs torch >= 2.12 "
                f"(UntypedStorage._swap_data_ptr_); this is torch {torch.__version__}. "
                f"Allocate outside the region, then adopt(..., {tag!r}) the module, "
                "optimizer or tensors."
            )
        return nullcontext()

    def claim(self, tag: str, storages: list[torch.UntypedStorage],
              backup: bool) -> list[torch.UntypedStorage]:
        """Move what a region allocated into the arena. Only a data-pointer swap can: the
        region saw the storages, not every tensor made from them (a Parameter wraps its
        data in a new tensor)."""
        return self._arena(tag).adopt([Held(s, []) for s in storages])

    def adopt(self, tag: str, held: list[Held], backup: bool) -> list[torch.UntypedStorage]:
        return self._arena(tag).adopt(held)

    def pause(self, tag: str, backup: bool, device: int | None = None,
              storages: list[torch.UntypedStorage] | None = None) -> None:
        """The arena knows its tag's chunks: `storages` are not needed here."""
        self._arena(tag).pause(backup)

    def resume(self, tag: str, nbytes: int = 0, device: int | None = None) -> None:
        self._arena(tag).resume()
