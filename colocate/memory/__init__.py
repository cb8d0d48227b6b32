"""Tagged memory per process: put memory under a tag, pause it, resume it.

    from colocate import memory

    with memory.region("generator", backup=True):   # allocations inside belong to the tag
        model = build_model()
    memory.adopt(optimizer, "trainer", backup=True)  # existing tensors, modules, optimizers
    memory.pause("trainer")     # memory goes back (to the OS on CPU, the driver on CUDA)
    memory.resume("trainer")    # same addresses; contents back when the tag has backup

Backends: torch_memory_saver on CUDA (`colocate.memory.cuda`), an mmap arena on CPU
(`colocate.memory.arena`). Without backup, a resumed tag holds memory again but its
contents are lost (zeros on CPU, garbage on CUDA). Every transition is checked first
and a bad one raises a `TaggedMemoryError`; the process stays usable (a pause while a region
of the tag is open, a CUDA resume without room, memory on a non-current GPU included). A
pause also runs `release_cached()`, which returns freed untagged memory that allocators keep
(a trainer's activations).

The functions below act on one registry per process, shared by every thread and actor.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from colocate.memory.backups import DISK, DROP, HOST, PLACES, BackupReading
from colocate.memory.cached import release_cached
from colocate.memory.cuda import check_allocator_conf, preload_env
from colocate.memory.errors import (
    CudaSetupError,
    ResumeOutOfMemoryError,
    SlotOutOfMemoryError,
    TagConflictError,
    TaggedMemoryError,
    TagPausedError,
    TagStateError,
    UnknownTagError,
)
from colocate.memory.registry import TagRegistry, TagState
from colocate.memory.traffic import Traffic

_registry = TagRegistry()


@contextmanager
def region(tag: str, backup: bool = False,
           device: str | torch.device | None = None) -> Iterator[None]:
    """Allocations made inside belong to `tag` (on `device`: CUDA if present, else CPU).

    On CPU the allocations are moved into the tag's arena when the block ends. Regions do
    not nest. `backup` is fixed per tag by its first use.
    """
    with _registry.region(tag, backup, device):
        yield


def adopt(obj: Any, tag: str, backup: bool = False) -> int:
    """Put the storage behind `obj` under `tag`; returns the bytes newly adopted.

    `obj` is a tensor, an `nn.Module` (parameters, gradients, buffers), an optimizer (its
    state) or a list/tuple/dict of these. Contents are kept; every view of an adopted
    storage follows it. Adopting again is a no-op for storages the tag already has.
    """
    return _registry.adopt(obj, tag, backup)


def pause(tag: str, place: str = HOST) -> int:
    """Release the tag's memory (with backup: after saving it at `place`, `HOST`, `DISK`
    or `DROP`: see `colocate.memory.backups`), and what the allocators
    keep of the process's freed memory (`release_cached`), so the reading taken after it,
    which the timeline and the leak tracker see, is what the process still holds (in a
    `pausing_together` block: both once the block ends). Returns the bytes the tag held
    (its `resident_bytes` just before)."""
    return _registry.pause(tag, place)


def pausing_together() -> AbstractContextManager[None]:
    """Pauses in this block (a tenant's sleep of several tags) give back the allocators'
    kept memory once, as the block ends, and take their after-readings then: one
    `release_cached` for the block instead of one a pause."""
    return _registry.pausing_together()


def resume(tag: str) -> None:
    """Hold the tag's memory again at the same addresses (with backup: its contents)."""
    _registry.resume(tag)


def state(tag: str) -> TagState:
    """ACTIVE or PAUSED."""
    return _registry.state(tag)


def ensure_active(tag: str) -> None:
    """Raise `TagPausedError` when `tag` is paused: call before using its tensors."""
    _registry.ensure_active(tag)


def resident_bytes(tag: str) -> int:
    """Bytes of the tag's live tensors held in memory now (0 while paused)."""
    return _registry.resident_bytes(tag)


def tagged_bytes(tag: str) -> int:
    """Bytes of the tag's live tensors, held or paused."""
    return _registry.tagged_bytes(tag)


def set_capacity(nbytes: int | None) -> None:
    """This process's slot capacity on CPU (None: none): a `region()` or `adopt()` that
    would take the resident tagged memory past it raises `SlotOutOfMemoryError` (see
    `colocate.memory.capacity`)."""
    _registry.capacity.bytes = nbytes


def ensure_room(nbytes: int, what: str) -> None:
    """Raise `SlotOutOfMemoryError` unless `nbytes` more CPU tagged memory fit under the
    slot's capacity: call before work that will tag that much (nothing is changed yet)."""
    _registry.check_room(what, "cpu", nbytes)


def set_backup_dir(path: str | None) -> None:
    """Where this process's backups to disk go (None: `$COLOCATE_BACKUP_DIR`, else the
    system temp dir)."""
    _registry.set_backup_dir(path)


def backup_reading(reset_peak: bool = False) -> BackupReading:
    """What this process's backups hold: host bytes now and at most since the last reading
    with `reset_peak` (or since the start), and disk bytes now."""
    return _registry.backup_reading(reset_peak)


def traffic() -> Traffic:
    """What this process's pauses and resumes moved so far: bytes copied to host backup
    and back, and bytes discarded (tags without backup)."""
    return _registry.traffic.total()


def tags() -> list[str]:
    """Every tag of this process, sorted."""
    return _registry.tags()


__all__ = [
    "DISK", "DROP", "HOST", "PLACES", "BackupReading", "backup_reading", "set_backup_dir",
    "CudaSetupError", "ResumeOutOfMemoryError", "SlotOutOfMemoryError", "TagConflictError",
    "TagPausedError", "TagState", "TagStateError", "TaggedMemoryError", "Traffic",
    "UnknownTagError", "adopt", "check_allocator_conf", "ensure_active", "ensure_room",
    "pause", "pausing_together", "preload_env", "region", "release_cached",
    "resident_bytes", "resume", "set_capacity", "state", "tagged_bytes", "tags", "traffic",
]
