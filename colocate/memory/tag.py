"""What the registry knows of one tag (`Tag`: its state, storages, devices, where its
contents wait while paused), and what it asks of a device's memory backend (`Backend`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from colocate.memory.backups import DROP
from colocate.memory.repoint import Held
from colocate.memory.storages import revive


class TagState(enum.Enum):
    ACTIVE = "active"
    PAUSED = "paused"


class Backend(Protocol):
    device_type: str

    def region(self, tag: str, backup: bool) -> Any: ...
    def claim(self, tag: str, storages: list[torch.UntypedStorage],
              backup: bool) -> list[torch.UntypedStorage]: ...
    def adopt(self, tag: str, held: list[Held],
              backup: bool) -> list[torch.UntypedStorage]: ...
    def pause(self, tag: str, place: str, device: int | None,
              storages: list[torch.UntypedStorage]) -> None: ...
    def resume(self, tag: str, nbytes: int, device: int | None) -> None: ...


@dataclass
class Tag:
    """What the registry knows of one tag."""

    name: str
    backup: bool
    state: TagState = TagState.ACTIVE
    storages: dict[int, StorageWeakRef] = field(default_factory=dict)
    devices: set[str] = field(default_factory=set)
    cuda_index: int | None = None  # the CUDA device of its CUDA memory
    resumed: set[str] = field(default_factory=set)  # device types resumed so far
    place: str = DROP  # where its contents wait while paused (backups.py)

    def live_storages(self, device_type: str | None = None) -> list[torch.UntypedStorage]:
        live = {cdata: revive(ref) for cdata, ref in self.storages.items()}
        self.storages = {c: self.storages[c] for c, s in live.items() if s is not None}
        return [s for s in live.values()
                if s is not None and device_type in (None, s.device.type)]

    def nbytes(self, device_type: str | None = None) -> int:
        return sum(s.nbytes() for s in self.live_storages(device_type))
