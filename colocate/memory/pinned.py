"""A tag's CUDA bytes kept in pinned host memory while the tag is paused.

torch_memory_saver's own CPU backup pauses at 3 GB/s and resumes at 10-11 GB/s on an H200,
against 55 GB/s for a copy of the same bytes to and from pinned host memory
(bench/RESULTS.md, "GPU session"; torch_memory_saver issue #111 reports ~0.1x). So the
CUDA backend pauses without it and keeps the bytes of the tag's live storages here: one
pinned buffer per tag, filled before the pause and emptied after the resume with
asynchronous copies, and kept for the next pause (pinning costs far more than a copy), so
a process holds pinned host memory the size of each backed-up tag from its first pause on.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from colocate.memory.repoint import as_bytes


class PinnedBackup:
    """The backups of paused tags: `save` before a pause, `restore` after the resume."""

    def __init__(self, pin: bool = True) -> None:
        self.pin = pin  # False only where there is no CUDA to pin for (tests on CPU)
        self.buffers: dict[str, torch.Tensor] = {}
        self.saved: dict[str, list[torch.UntypedStorage]] = {}

    def save(self, tag: str, storages: list[torch.UntypedStorage]) -> None:
        """Copy the storages' bytes into the tag's buffer, and hold the storages until
        `restore` (none is freed while its tag is paused)."""
        total = sum(s.nbytes() for s in storages)
        if tag not in self.buffers or self.buffers[tag].numel() < total:
            self.buffers.pop(tag, None)  # the old buffer goes before the new one is pinned
            self.buffers[tag] = torch.empty(total, dtype=torch.uint8, pin_memory=self.pin)
        for kept, held in _pairs(self.buffers[tag], storages):
            kept.copy_(held, non_blocking=True)
        _wait(storages)
        self.saved[tag] = storages

    def restore(self, tag: str) -> None:
        """Copy the saved bytes back into the storages (mapped again by the resume); a
        tag saved with nothing, or not saved, has nothing to restore. On failure the
        backup stays, for a retry."""
        storages = self.saved.get(tag)
        if storages is None:
            return
        for kept, held in _pairs(self.buffers[tag], storages):
            held.copy_(kept, non_blocking=True)
        _wait(storages)
        del self.saved[tag]

    def drop(self, tag: str) -> None:
        """Forget the tag's saved storages (its pause did not happen); the buffer stays."""
        self.saved.pop(tag, None)


def _pairs(buffer: torch.Tensor, storages: list[torch.UntypedStorage]
           ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(the buffer's slice, the storage's bytes) for each storage, packed in order."""
    offset = 0
    for storage in storages:
        size = storage.nbytes()
        yield buffer[offset:offset + size], as_bytes(storage)
        offset += size


def _wait(storages: list[torch.UntypedStorage]) -> None:
    """Wait for the copies on each CUDA device the storages are on."""
    for index in {s.device.index for s in storages if s.device.type == "cuda"}:
        torch.cuda.synchronize(index)
