"""How fast this machine moves a slot's memory: the rates a plan turns bytes into seconds,
measured by a short calibration and kept in a file.

`calibrate(device)` times, on `device` ("cpu", or "cuda" for the current GPU), what a
switch does to a stage: the memory layer's own pause and resume of a tag with backup (the
copy to host memory and back; on CPU, to a file in the backup directory and back too, where
a host short of memory for backups puts them) and without (a drop, and its refill at the
wake), and a copy
within the slot (a sync's weights copied in place); and the raw copies between host and
slot memory, pinned and not (on CPU slots, which are host memory, a memcpy). A switch also
has a fixed cost per way (its messages, the release checks, the view's bookkeeping), a cost
per tensor it handles (each is paused, repointed or copied on its own), and its bytes cost
more than a lone copy's, which the caller measures on its own runtime and adds
(`Rates.fixed_s`: "wake" and "sync" through the arbiter, "in_place" for a sync's copy alone,
"none" for a wake with nothing to do; 0 until measured; `per_tensor_s`, 0 until measured;
`byte_scale`, the bytes' time over the rates' own, 1 until measured; `fixed_per_slot_s`,
`per_tensor_per_slot_s` and `byte_scale_per_slot`, what each further slot of a host adds,
since one arbiter a host carries out every slot's switch and the slots share the host's
memory; `disk_stage_s`, `disk_out_scale` and `disk_in_scale`, what a backup on disk costs
in a real switch: a file per stage, and its bytes written and read beyond a lone copy's),
and so is the peak memory of the process that drives a run (`process_bytes`), part of the
host's.

`load_rates(path)` reads a file written by `save`; `cached_rates(device)` reads this
machine's (`default_path`) or calibrates and writes it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from colocate import memory

CALIBRATION_BYTES = 64 << 20  # the stage a calibration moves
ROUNDS = 3  # each figure: the median of this many


@dataclass(frozen=True)
class Rates:
    """Bytes per second of each way a stage moves, and a switch's fixed cost per way."""

    device: str  # "cpu", or the GPU's name
    backup_out: float  # a pause with backup: slot -> host memory
    backup_in: float  # a resume with backup: host memory -> slot
    drop: float  # a pause without backup
    refill: float  # a resume without backup (memory held again, contents not)
    in_slot: float  # a copy within slot memory (a sync's weights, in place)
    pinned_to_slot: float | None = None  # raw copies (CUDA only: on CPU slots, None)
    slot_to_pinned: float | None = None
    pageable_to_slot: float | None = None  # raw copies from unpinned host memory
    slot_to_pageable: float | None = None
    disk_out: float | None = None  # a pause with backup to disk (CPU tags; None: as host's)
    disk_in: float | None = None  # its resume, read back from disk
    fixed_s: dict[str, float] = field(default_factory=dict)  # way -> seconds a switch
    # way -> the seconds each further slot of the host adds to a switch (one arbiter a host)
    fixed_per_slot_s: dict[str, float] = field(default_factory=dict)
    # way -> what a real switch's bytes take over their time at the rates above (1 when not
    # measured), and what each further slot of the host adds to it (they share its memory)
    byte_scale: dict[str, float] = field(default_factory=dict)
    byte_scale_per_slot: dict[str, float] = field(default_factory=dict)
    # way -> the seconds each tensor a switch handles adds, and what a further slot adds
    per_tensor_s: dict[str, float] = field(default_factory=dict)
    per_tensor_per_slot_s: dict[str, float] = field(default_factory=dict)
    # a backup on disk in a real switch: each stage's file, and its bytes' time over the
    # disk rates', written and read back (None: the way's byte scale), as the caller
    # measured them
    disk_stage_s: float = 0.0
    disk_out_scale: float | None = None
    disk_in_scale: float | None = None
    process_bytes: int = 0  # the driving process's peak memory, as its caller measured it
    slot_bytes: int = 0  # a GPU's memory (measured on CUDA): `auto` slots' capacity there
    host: str = ""  # the machine measured
    measured_at: str = ""

    @property
    def on_gpu(self) -> bool:
        """Whether these are a GPU's rates (its slots' backups pinned), not CPU slots'."""
        return self.device != "cpu"

    def seconds(self, way: str, copied_out: int = 0, copied_in: int = 0, discarded: int = 0,
                refilled: int = 0, in_slot: int = 0, slots: int = 1, to_disk: int = 0,
                from_disk: int = 0, tensors: int = 0, disk_stages: int = 0) -> float:
        """A switch's predicted time on a host of `slots` slots switching together: its
        way's fixed cost, its cost per tensor of one slot (`tensors`), each byte of one
        slot at its rate (`copied_out`/`copied_in`: to host memory and back) times the
        way's byte scale, and its backups on disk (`to_disk`/`from_disk` bytes, in
        `disk_stages` files)."""
        more = slots - 1
        scale = self.byte_scale.get(way, 1.0) + more * self.byte_scale_per_slot.get(way, 0.0)
        per_tensor = self.per_tensor_s.get(way, 0.0) \
            + more * self.per_tensor_per_slot_s.get(way, 0.0)
        written, read = self.disk_times(to_disk, from_disk)
        return (self.fixed_s.get(way, 0.0) + more * self.fixed_per_slot_s.get(way, 0.0)
                + per_tensor * tensors
                + scale * (copied_out / self.backup_out
                           + copied_in / self.backup_in + discarded / self.drop
                           + refilled / self.refill + in_slot / self.in_slot)
                + self.disk_stage_s * disk_stages
                + (scale if self.disk_out_scale is None else self.disk_out_scale) * written
                + (scale if self.disk_in_scale is None else self.disk_in_scale) * read)

    def disk_times(self, to_disk: int, from_disk: int) -> tuple[float, float]:
        """The raw seconds of `to_disk` bytes written to disk and `from_disk` read back (at
        the host's rates where the disk's were not measured)."""
        return (to_disk / (self.disk_out or self.backup_out),
                from_disk / (self.disk_in or self.backup_in))

    def with_switch_costs(self, one_slot: dict[str, tuple[float, float, float]],
                          per_slot: dict[str, tuple[float, float, float]],
                          process_bytes: int) -> Rates:
        """These rates with each way's measured (fixed seconds, seconds per tensor, byte
        scale) on one slot and what each further slot adds to them (other ways kept), and
        `process_bytes`."""
        def merged(old: dict[str, float], fits: dict[str, tuple[float, float, float]],
                   index: int) -> dict[str, float]:
            return {**old, **{way: fit[index] for way, fit in fits.items()}}

        return dataclasses.replace(
            self, fixed_s=merged(self.fixed_s, one_slot, 0),
            per_tensor_s=merged(self.per_tensor_s, one_slot, 1),
            byte_scale=merged(self.byte_scale, one_slot, 2),
            fixed_per_slot_s=merged(self.fixed_per_slot_s, per_slot, 0),
            per_tensor_per_slot_s=merged(self.per_tensor_per_slot_s, per_slot, 1),
            byte_scale_per_slot=merged(self.byte_scale_per_slot, per_slot, 2),
            process_bytes=process_bytes)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # processes calibrating at once
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=2))
        tmp.replace(path)


def load_rates(path: Path) -> Rates:
    """The rates in `path` (a file `Rates.save` wrote); ValueError naming what is wrong."""
    try:
        found = json.loads(Path(path).read_text())
        return Rates(**found)
    except (OSError, json.JSONDecodeError, TypeError) as err:
        raise ValueError(f"rates file {path}: {err}") from err


def default_path(device: str = "cpu") -> Path:
    """This machine's rates file: $COLOCATE_RATES, else under the user's cache directory."""
    if os.environ.get("COLOCATE_RATES"):
        return Path(os.environ["COLOCATE_RATES"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "colocate" / f"rates-{platform.node()}-{device}.json"


def cached_rates(device: str = "cpu", path: Path | None = None) -> Rates:
    """This machine's rates from its file (`default_path`), calibrated and written first
    when there is none."""
    path = path or default_path(device)
    if path.exists():
        return load_rates(path)
    rates = calibrate(device)
    rates.save(path)
    return rates


def calibrate(device: str = "cpu", nbytes: int = CALIBRATION_BYTES) -> Rates:
    """Measure the rates on `device` (see module); a second or two."""
    on = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" \
        else torch.device("cpu")

    def rate(run: Callable[[], Callable[[], None]]) -> float:
        """Bytes per second of the timed part `run()` returns, its median over ROUNDS."""
        times = []
        for _ in range(ROUNDS):
            timed = run()
            _sync(on)
            began = time.perf_counter()
            timed()
            _sync(on)
            times.append(time.perf_counter() - began)
        return nbytes / max(statistics.median(times), 1e-9)

    found: dict[str, Any] = {}
    ways = [("backup", True, memory.HOST, "backup_out", "backup_in"),
            ("drop", False, memory.HOST, "drop", "refill")]
    if on.type == "cpu":  # backups to disk are CPU tags'
        ways.append(("disk", True, memory.DISK, "disk_out", "disk_in"))
    for name, backup, place, out_key, in_key in ways:
        tag = f"calibration/{name}-{os.getpid()}"
        stage = torch.ones(nbytes, dtype=torch.uint8, device=on)
        memory.adopt(stage, tag, backup=backup)
        found[out_key] = rate(lambda tag=tag, p=place: _then(tag, memory.TagState.ACTIVE, p))
        found[in_key] = rate(lambda tag=tag: _then(tag, memory.TagState.PAUSED))
        if memory.state(tag) is memory.TagState.PAUSED:
            memory.resume(tag)
        del stage
    source = torch.ones(nbytes, dtype=torch.uint8, device=on)
    target = torch.empty_like(source)
    found["in_slot"] = rate(lambda: lambda: target.copy_(source))
    if on.type == "cuda":
        for pin, to_key, from_key in ((True, "pinned_to_slot", "slot_to_pinned"),
                                      (False, "pageable_to_slot", "slot_to_pageable")):
            host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pin)
            found[to_key] = rate(lambda host=host: lambda: target.copy_(host, non_blocking=True))
            found[from_key] = rate(lambda host=host: lambda: host.copy_(target, non_blocking=True))
    if on.type == "cuda":
        found["slot_bytes"] = torch.cuda.get_device_properties(on).total_memory
    name = torch.cuda.get_device_name(on) if on.type == "cuda" else "cpu"
    return Rates(device=name, host=platform.node(),
                 measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"), **found)


def _then(tag: str, state: memory.TagState, place: str = memory.HOST) -> Callable[[], None]:
    """Bring `tag` to `state` now (untimed); the timed part leaves it: an active tag is
    paused (its backup at `place`), a paused one resumed."""
    if memory.state(tag) is not state:
        if state is memory.TagState.PAUSED:
            memory.pause(tag, place)
        else:
            memory.resume(tag)
    if state is memory.TagState.ACTIVE:
        return lambda: memory.pause(tag, place)
    return lambda: memory.resume(tag)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
