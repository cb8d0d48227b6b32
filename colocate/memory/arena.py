"""CPU backend: an mmap arena per tag whose pages go back to the OS on pause.

`adopt` copies each storage into an anonymous private mapping and re-points the storage's
tensors to it (`colocate.memory.repoint`: a data-pointer swap, so every view follows, or
on torch 2.11 `Tensor.set_` on each tensor found). `pause` copies the mappings to the
place asked (`backups.py`): a host buffer of exactly their bytes, or an unlinked file in
the backup directory (kept after the resume for the tag's next pause to disk: rewriting a
file's blocks costs less than writing a new file's, and varies less; bench/RESULTS.md,
bench.plan's r8); or, without backup or to `DROP`, keeps nothing. It
`MADV_DONTNEED`s each piece of `PIECE` bytes as soon as it is copied, so a stage is never
held twice in host memory beyond one piece. `resume` copies the backup back into the same
addresses, or faults in zeroed pages, so `data_ptr()` is the same before and after.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import weakref
from contextlib import AbstractContextManager, nullcontext

import torch

from colocate.memory.backups import DISK, DROP, HOST, BackupCount, backup_directory
from colocate.memory.errors import TaggedMemoryError
from colocate.memory.repoint import Held, mode, move

HUGE_PAGE = 2 << 20
PIECE = 32 * HUGE_PAGE  # copied, then released, at a time
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

    def release(self, start: int = 0, length: int | None = None) -> None:
        """Give back the pages of [start, start + length) (default: all); `start` is a
        multiple of the page size."""
        self.madvise(mmap.MADV_DONTNEED, start, len(self) - start if length is None
                     else min(length, len(self) - start))

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


class Copy:
    """A backup of `nbytes`: an unlinked file, written and read with `pwrite`/`preadv`
    (never mapped), gone when closed. In host memory (`host`, a `memfd`: shared memory
    pages, not counted in the process's RSS, so a CPU slot's release is measured as a
    GPU's is, while the host's memory holds the backup) or on disk in `directory`."""

    def __init__(self, nbytes: int, directory: str | None = None) -> None:
        self.nbytes = nbytes
        self.directory = directory
        self.place = HOST if directory is None else DISK
        self.file = None if directory is None else tempfile.TemporaryFile(dir=directory)
        self.fd = os.memfd_create("colocate-backup", os.MFD_CLOEXEC) if self.file is None \
            else self.file.fileno()

    def write(self, view: memoryview, offset: int) -> None:
        _write_all(self.fd, view, offset)

    def read(self, view: memoryview, offset: int) -> None:
        _read_all(self.fd, view, offset)

    def close(self) -> None:
        if self.file is None:
            os.close(self.fd)
        else:
            self.file.close()


class TagArena:
    """The chunks of one tag and, while it is paused with backup, their backup; after a
    backup on disk is read back, its file (`spare`), which the next backup to the same
    directory rewrites."""

    def __init__(self) -> None:
        self.chunks: list[weakref.ref[Chunk]] = []
        self.backup: Copy | None = None
        self.spare: Copy | None = None

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

    def pause(self, place: str, directory: str | None) -> int:
        """Release the chunks, first copied into a backup unless `place` is `DROP` (in
        host memory, or a file in `directory` for `DISK`); returns the bytes it holds."""
        chunks = self.live_chunks()
        if place != DROP:
            nbytes = sum(c.used for c in chunks)
            self.backup = _save(chunks, self._copy(nbytes, directory if place == DISK
                                                   else None))
        for chunk in chunks:
            chunk.release()
        return 0 if self.backup is None else self.backup.nbytes

    def resume(self) -> int:
        """Hold the chunks again, their contents copied back from the backup (if any);
        returns the bytes the backup held (now freed)."""
        chunks = self.live_chunks()
        backup, self.backup = self.backup, None
        if backup is None:
            for chunk in chunks:
                chunk.populate()
            return 0
        offset = 0
        for chunk in chunks:
            with memoryview(chunk) as view:
                backup.read(view[:chunk.used], offset)
            offset += chunk.used
        if backup.place == DISK:
            self.spare = backup
        else:
            backup.close()
        return backup.nbytes

    def _copy(self, nbytes: int, directory: str | None) -> Copy:
        """A backup of `nbytes`: the spare file if it is in `directory`, else a new one."""
        spare, self.spare = self.spare, None
        if spare is not None and spare.directory == directory:  # a spare is on disk
            spare.nbytes = nbytes
            return spare
        if spare is not None:
            spare.close()
        return Copy(nbytes, directory)


def _save(chunks: list[Chunk], backup: Copy) -> Copy:
    """Copy the chunks into `backup` a piece at a time, each piece released once copied
    (never two copies of it in host memory beyond a piece); on failure the released
    pieces are copied back, the backup is closed and nothing is lost."""
    done: list[tuple[Chunk, int, int, int]] = []  # chunk, start, length, backup offset
    offset = 0
    try:
        for chunk in chunks:
            with memoryview(chunk) as view:
                for start in range(0, chunk.used, PIECE):
                    length = min(PIECE, chunk.used - start)
                    backup.write(view[start:start + length], offset + start)
                    chunk.release(start, length)
                    done.append((chunk, start, length, offset + start))
            offset += chunk.used
    except BaseException:
        for chunk, start, length, at in done:
            with memoryview(chunk) as view:
                backup.read(view[start:start + length], at)
        backup.close()
        raise
    return backup


class ArenaBackend:
    """The CPU backend: one `TagArena` per tag."""

    device_type = "cpu"

    def __init__(self, backup_dir: str | None = None, count: BackupCount | None = None
                 ) -> None:
        self.backup_dir = backup_dir  # None: $COLOCATE_BACKUP_DIR, else the temp dir
        self.count = count or BackupCount()
        self.arenas: dict[str, TagArena] = {}

    def _arena(self, tag: str) -> TagArena:
        return self.arenas.setdefault(tag, TagArena())

    def directory(self) -> str:
        """Where backups to disk go (see `backups.py`)."""
        return backup_directory(self.backup_dir)

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

    def pause(self, tag: str, place: str, device: int | None = None,
              storages: list[torch.UntypedStorage] | None = None) -> None:
        """Pause to `place` (`backups.py`). The arena knows its tag's chunks: `storages`
        are not needed here."""
        self.count.add(place, self._arena(tag).pause(place, self.directory()))

    def resume(self, tag: str, nbytes: int = 0, device: int | None = None) -> None:
        arena = self._arena(tag)
        place = arena.backup.place if arena.backup is not None else DROP
        self.count.add(place, -arena.resume())
