"""The per-process registry of memory tags: states, checked transitions, measurements.

A tag is created by its first `region()` or `adopt()` and is ACTIVE or PAUSED. Every
transition is checked here, under one lock, before a backend sees it: a pause is refused
while a region of the tag is open in any thread (torch_memory_saver would leave the
region's later allocations active under a paused tag, and exit(1) at the next resume). A
tag's CUDA memory is on one device, the current one when it got memory. Each pause and
resume is measured (memory before and after) into the telemetry timeline, and the memory
left after each pause feeds the leak tracker.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from colocate import telemetry
from colocate.memory.backups import DROP, HOST, PLACES, BackupCount, BackupReading
from colocate.memory.cached import release_cached
from colocate.memory.capacity import Capacity
from colocate.memory.devices import check_cuda_device, resolve_device
from colocate.memory.errors import (
    SlotOutOfMemoryError,
    TagConflictError,
    TaggedMemoryError,
    TagPausedError,
    TagStateError,
    UnknownTagError,
)
from colocate.memory.repoint import Held, complete
from colocate.memory.storages import Capture, collect_held
from colocate.memory.tag import Backend, Tag, TagState
from colocate.memory.traffic import TrafficCounter


def _reading(device_type: str, index: int | None) -> tuple[int, str]:
    """Memory held now and its scope: this process's ("process"), or on CUDA where NVML
    does not account per process, the whole device's ("device")."""
    if device_type == "cuda":
        reading = telemetry.read_gpu_process(torch.cuda.current_device() if index is None
                                             else index)
        return reading.used_bytes, reading.scope
    return telemetry.process_rss(), "process"


class TagRegistry:
    """All tags of this process and the backends that hold their memory."""

    def __init__(self) -> None:
        self._tags: dict[str, Tag] = {}
        self._backends: dict[str, Backend] = {}
        self._lock = threading.RLock()
        self._in_region = threading.local()
        self._open: dict[str, list[str]] = {}  # tag -> threads with a region of it open
        self._unfinished: list[Callable[[], None]] | None = None  # pauses held together
        self._release_due = False  # a pause of the block gives back the allocators' memory
        self.traffic = TrafficCounter()  # what pauses and resumes moved
        self.capacity = Capacity()  # a CPU slot's, when its arbiter gives one
        self.backups = BackupCount()  # the host and disk bytes its backups hold
        self.backup_dir: str | None = None  # backups to disk (None: backups.py's default)

    # -- backends and tags ------------------------------------------------------------

    def _backend(self, device_type: str) -> Backend:
        if device_type not in self._backends:
            if device_type == "cpu":
                from colocate.memory.arena import ArenaBackend

                self._backends["cpu"] = ArenaBackend(self.backup_dir, self.backups)
            elif device_type == "cuda":
                from colocate.memory.cuda import CudaBackend

                self._backends["cuda"] = CudaBackend(self.backups)
            else:
                raise TaggedMemoryError(
                    f"no memory backend for device type {device_type!r}: use 'cpu' or 'cuda'."
                )
        return self._backends[device_type]

    def _get(self, tag: str) -> Tag:
        try:
            return self._tags[tag]
        except KeyError:
            raise UnknownTagError(
                f"unknown memory tag {tag!r}: give it memory with region() or adopt() first "
                f"(known tags: {sorted(self._tags) or 'none'})."
            ) from None

    def _writable(self, tag: str, backup: bool) -> Tag:
        """The tag to add memory to, created if new; refuses a paused tag or a new policy."""
        if not isinstance(tag, str) or not tag:
            raise TaggedMemoryError(f"a memory tag is a non-empty string, got {tag!r}.")
        record = self._tags.setdefault(tag, Tag(tag, backup))
        if record.backup != backup:
            raise TagConflictError(
                f"tag {tag!r} was created with backup={record.backup}; it cannot take memory "
                f"with backup={backup}. Use another tag for memory with another policy."
            )
        if record.state is TagState.PAUSED:
            raise TagPausedError(
                f"tag {tag!r} is paused: resume({tag!r}) before adding memory to it."
            )
        return record

    def _check_unowned(self, tag: str, storages: list[torch.UntypedStorage]) -> None:
        for storage in storages:
            owner = self._owner(storage)
            if owner is not None:
                raise TagConflictError(
                    f"a storage of {storage.nbytes()} bytes already belongs to tag "
                    f"{owner.name!r}; it cannot also belong to {tag!r}."
                )

    def _check_device(self, record: Tag, device: torch.device) -> None:
        if device.type == "cuda":
            check_cuda_device(record.name, device, torch.cuda.current_device(),
                              record.cuda_index)

    def _track(self, record: Tag, storages: list[torch.UntypedStorage]) -> None:
        for storage in storages:
            record.storages.setdefault(storage._cdata, StorageWeakRef(storage))
            record.devices.add(storage.device.type)
            if storage.device.type == "cuda":
                record.cuda_index = storage.device.index

    def _owner(self, storage: torch.UntypedStorage) -> Tag | None:
        for record in self._tags.values():
            ref = record.storages.get(storage._cdata)
            if ref is not None and not ref.expired():
                return record
        return None

    # -- giving memory to a tag ---------------------------------------------------------

    @contextmanager
    def region(self, tag: str, backup: bool = False,
               device: str | torch.device | None = None) -> Iterator[None]:
        device = resolve_device(device)
        if getattr(self._in_region, "tag", None) is not None:
            raise TagConflictError(
                f"region({tag!r}) inside region({self._in_region.tag!r}): regions do not nest."
            )
        with self._lock:
            record = self._writable(tag, backup)
            self._check_device(record, device)
            backend = self._backend(device.type)
            self._open.setdefault(tag, []).append(threading.current_thread().name)
        capture = Capture(device.type)
        self._in_region.tag = tag
        elsewhere: list[torch.UntypedStorage] = []
        refused: Exception | None = None
        try:
            with backend.region(tag, backup), capture:
                yield
        finally:
            self._in_region.tag = None
            with self._lock:
                self._open[tag].remove(threading.current_thread().name)
                if not self._open[tag]:
                    del self._open[tag]
                live = [s for s in capture.live() if self._owner(s) is None]
                elsewhere = [s for s in live if s.device != device]
                here = [s for s in live if s.device == device]
                try:
                    self.check_room(f"tag {tag!r}", device.type, sum(s.nbytes() for s in here))
                    self._track(record, backend.claim(tag, here, backup))
                except SlotOutOfMemoryError as err:
                    refused = err  # left untagged: freed with the caller's references
        if refused is not None:
            raise refused
        if elsewhere:  # the block itself succeeded: say what it left untagged
            raise TagConflictError(
                f"region({tag!r}) on {device} allocated {sum(s.nbytes() for s in elsewhere)} "
                f"bytes on {sorted({str(s.device) for s in elsewhere})}, which are not tagged: "
                "torch_memory_saver tags only the current device's allocations. Allocate on "
                f"{device} inside the region, or use one region per device after "
                "torch.cuda.set_device()."
            )

    def adopt(self, obj: Any, tag: str, backup: bool = False) -> int:
        with self._lock:
            record = self._writable(tag, backup)
            held = [h for h in collect_held(obj) if h.storage._cdata not in record.storages]
            # every check runs before anything moves
            self._check_unowned(tag, [h.storage for h in held])
            by_device: dict[torch.device, list[Held]] = {}
            for h in held:
                by_device.setdefault(h.storage.device, []).append(h)
            for device, group in by_device.items():
                self._check_device(record, device)
                self.check_room(f"tag {tag!r}", device.type, sum(h.storage.nbytes() for h in group))
            complete(held, tag)
            for device, group in by_device.items():
                self._track(record, self._backend(device.type).adopt(tag, group, backup))
            return sum(h.storage.nbytes() for h in held)

    def check_room(self, what: str, device_type: str, asked: int) -> None:
        """On CPU, refuse `asked` more bytes for `what` past the slot's capacity."""
        if device_type == "cpu" and self.capacity.bytes is not None:
            with self._lock:
                held = sum(r.nbytes("cpu") for r in self._tags.values()
                           if r.state is TagState.ACTIVE)
            self.capacity.check(held, asked, what)

    # -- transitions -----------------------------------------------------------------

    def set_backup_dir(self, path: str | None) -> None:
        """Where backups to disk go from now on (None: `backups.py`'s default)."""
        with self._lock:
            self.backup_dir = path
            if "cpu" in self._backends:
                self._backends["cpu"].backup_dir = path

    def pause(self, tag: str, place: str = HOST) -> int:
        """Pause `tag` on each of its devices, its contents (with backup) kept at `place`
        (`backups.py`); returns the bytes it held (counted once: walking a tag's storages
        costs a few microseconds each, and a switch pauses several tags)."""
        if place not in PLACES:
            raise TaggedMemoryError(f"pause({tag!r}, place={place!r}): use one of {PLACES}")
        with self._lock:
            record = self._get(tag)
            place = place if record.backup else DROP
            if record.state is TagState.PAUSED:
                raise TagStateError(f"tag {tag!r} is already paused; resume({tag!r}) first.")
            if tag in self._open:
                raise TagStateError(
                    f"tag {tag!r} has a region open in thread(s) {self._open[tag]}: pause it "
                    "after the region ends (its later allocations would stay active under "
                    "a paused tag). Pause a tag from the thread or actor that fills it."
                )
            done: list[str] = []
            held = 0
            try:
                for device_type in sorted(record.devices):
                    storages = record.live_storages(device_type)
                    nbytes = sum(s.nbytes() for s in storages)
                    self._measured("pause", record, device_type, nbytes,
                                   lambda b, s=storages: b.pause(tag, place,
                                                                 record.cuda_index, s))
                    done.append(device_type)
                    held += nbytes
            except BaseException as err:
                for device_type in done:
                    self._backend(device_type).resume(tag, record.nbytes(device_type),
                                                      record.cuda_index)
                raise TaggedMemoryError(
                    f"pause({tag!r}) failed on {device_type}; the tag is still active "
                    f"({', '.join(done) or 'nothing'} rolled back): {err}"
                ) from err
            record.state, record.place = TagState.PAUSED, place
            self.traffic.paused(held, place != DROP)
            return held

    def resume(self, tag: str) -> None:
        with self._lock:
            record = self._get(tag)
            if record.state is TagState.ACTIVE:
                raise TagStateError(f"tag {tag!r} is already active; pause({tag!r}) first.")
            # CUDA first: its resume is the one that can be refused for want of memory,
            # and a resumed device is not resumed again when the resume is retried
            for device_type in sorted(record.devices - record.resumed, reverse=True):
                nbytes = record.nbytes(device_type)
                try:
                    self._measured("resume", record, device_type, nbytes,
                                   lambda b, n=nbytes: b.resume(tag, n, record.cuda_index))
                except BaseException as err:
                    raise TaggedMemoryError(
                        f"resume({tag!r}) failed on {device_type}; the tag stays paused and "
                        f"resume({tag!r}) may be retried: {err}"
                    ) from err
                record.resumed.add(device_type)
                self.traffic.resumed(nbytes, record.place != DROP)
            record.resumed.clear()
            record.state = TagState.ACTIVE

    @contextmanager
    def pausing_together(self) -> Iterator[None]:
        """Pauses in this block give back what the allocators keep (`release_cached`) once,
        as it ends, and take their after-readings then: one `malloc_trim` a sleep rather
        than one a tag (the trim walks every free chunk of the heap, and costs more as a
        long run fragments it). A nested block joins the outer one."""
        with self._lock:
            if self._unfinished is not None:
                yield
                return
            self._unfinished, self._release_due = [], False
            try:
                yield
            finally:
                unfinished, self._unfinished = self._unfinished, None
                if self._release_due:
                    release_cached()
                for finish in unfinished:
                    finish()

    def _gives_back(self, device_type: str) -> bool:
        """Whether a pause on `device_type` gives back the allocators' kept memory: always,
        but for a CPU pause in a slot with a declared capacity. There the slot's budget
        counts tagged memory only (`capacity`), so malloc's free lists take no room from
        the tenant that wakes, while trimming them cost a switch 12 ms after a train step
        of width 256 (which then faulted the pages back in: bench/RESULTS.md)."""
        return device_type != "cpu" or self.capacity.bytes is None

    def _measured(self, op: str, record: Tag, device_type: str, nbytes: int,
                  action) -> None:
        """Run `action` on the backend of `device_type` and record it in the timeline
        (`nbytes`: the tag's bytes there, counted by the caller, which needs them too)."""
        backend = self._backend(device_type)
        start, (before, _) = time.time(), _reading(device_type, record.cuda_index)
        began = time.perf_counter()
        action(backend)
        seconds = time.perf_counter() - began

        def finish() -> None:
            after, scope = _reading(device_type, record.cuda_index)
            telemetry.timeline().record(telemetry.SwitchEvent(
                op=op, tag=record.name, nbytes=nbytes, seconds=seconds, before_bytes=before,
                after_bytes=after, start=start, pid=os.getpid(),
                device=device_type if record.cuda_index is None or device_type != "cuda"
                else f"cuda:{record.cuda_index}",
            ))
            if op == "pause":
                # a device-wide reading moves with other processes too: allow for them
                telemetry.leak_tracker().observe(
                    f"{record.name}@{device_type}", after,
                    min_tolerance_bytes=telemetry.DEVICE_WIDE_TOLERANCE_BYTES
                    if scope == "device" else 0)

        if op != "pause":
            finish()
        elif self._unfinished is not None:  # a block of pauses: read once it ends
            self._unfinished.append(finish)
            self._release_due |= self._gives_back(device_type)
        else:  # what the allocators keep of freed memory goes too (untimed)
            if self._gives_back(device_type):
                release_cached()
            finish()

    # -- queries -----------------------------------------------------------------------

    def state(self, tag: str) -> TagState:
        with self._lock:
            return self._get(tag).state

    def ensure_active(self, tag: str) -> None:
        if self.state(tag) is TagState.PAUSED:
            raise TagPausedError(
                f"tag {tag!r} is paused: its tensors hold no memory until resume({tag!r})."
            )

    def resident_bytes(self, tag: str) -> int:
        with self._lock:
            record = self._get(tag)
            return 0 if record.state is TagState.PAUSED else record.nbytes()

    def tagged_bytes(self, tag: str) -> int:
        with self._lock:
            return self._get(tag).nbytes()

    def backup_reading(self, reset_peak: bool = False) -> BackupReading:
        """What this process's backups hold (`BackupCount.read`)."""
        return self.backups.read(reset_peak)

    def tags(self) -> list[str]:
        with self._lock:
            return sorted(self._tags)
