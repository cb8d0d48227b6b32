"""Find the tensor storages that belong to a tag.

`collect()` walks tensors, modules, optimizers and containers of them (a DTensor counts as
its local shard); `Capture` is a
dispatch mode that records the storages allocated while it is active (what `region()`
gives its tag). Storages are tracked by weak reference, so tracking never keeps memory
alive.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from colocate.memory.repoint import Held


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that holds memory: a DTensor's (FSDP's sharded parameters) local shard."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield _local(obj)
        if obj.grad is not None:
            yield _local(obj.grad)
    elif isinstance(obj, torch.nn.Module):
        yield from _tensors(list(obj.parameters()))
        yield from obj.buffers()
    elif isinstance(obj, torch.optim.Optimizer):
        yield from _tensors(list(obj.state.values()))
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, Iterable) and not isinstance(obj, (str, bytes)):
        for item in obj:
            yield from _tensors(item)


def collect_held(obj: Any) -> list[Held]:
    """The distinct, non-empty storages behind `obj`, each with the distinct tensors found
    viewing it.

    `obj` is a tensor, an `nn.Module` (parameters, their gradients, buffers), an optimizer
    (its state), or a list/tuple/dict of these. Parameter gradients come along.
    """
    found: dict[int, Held] = {}
    seen: set[int] = set()
    for tensor in _tensors(obj):
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        found.setdefault(storage._cdata, Held(storage, [])).tensors.append(tensor)
    return list(found.values())


def collect(obj: Any) -> list[torch.UntypedStorage]:
    """The distinct, non-empty storages behind `obj` (see `collect_held`)."""
    return [held.storage for held in collect_held(obj)]


def revive(ref: StorageWeakRef) -> torch.UntypedStorage | None:
    """The storage behind a weak reference, or None when it has been freed."""
    if ref.expired():
        return None
    return torch.UntypedStorage._new_with_weak_ptr(ref.cdata)


class Capture(TorchDispatchMode):
    """Records every storage that an operation allocates while the mode is active.

    An output storage is new when it is not one of the operation's inputs (in-place
    ops and views return their inputs' storages). Only storages on `device_type` count.
    """

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.refs: dict[int, StorageWeakRef] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {s._cdata for s in self._storages(tree_flatten((args, kwargs))[0])}
        for storage in self._storages(tree_flatten(out)[0]):
            if storage._cdata not in inputs and storage.nbytes() > 0:
                self.refs.setdefault(storage._cdata, StorageWeakRef(storage))
        return out

    def _storages(self, leaves: list[Any]) -> Iterator[torch.UntypedStorage]:
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.device.type == self.device_type:
                yield leaf.untyped_storage()

    def live(self) -> list[torch.UntypedStorage]:
        """The recorded storages that are still alive."""
        return [s for s in map(revive, self.refs.values()) if s is not None]
