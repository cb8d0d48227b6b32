"""Move a storage's contents into new memory and make its tensors use it (how `adopt` puts
existing tensors under a tag).

Two ways, chosen by feature detection (`COLOCATE_REPOINT=swap|set` forces one):

- "swap": `UntypedStorage._swap_data_ptr_` (torch >= 2.12) swaps the memory behind the
  storage in place; every tensor and view of the storage follows.
- "set": torch 2.11 (the lent GPU machine's) has no `_swap_data_ptr_`, so each tensor
  viewing the storage is re-pointed with `Tensor.set_(new_storage, offset, size, stride)`
  under no_grad. `complete` finds them: those `collect` found, and where the storage's use
  count says there are more (a `state_dict()` copy, a slice kept in an attribute), every
  tensor object the garbage collector knows. What it cannot move is a view that no Python
  object holds (one saved by autograd for a backward, DDP's gradient buckets): that one
  would keep the old memory, untagged, so `complete` refuses before anything moves.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch

from colocate.memory.errors import TagConflictError

REPOINT_ENV = "COLOCATE_REPOINT"


def has_swap() -> bool:
    """Whether this torch has `UntypedStorage._swap_data_ptr_` (torch >= 2.12)."""
    return hasattr(torch.UntypedStorage, "_swap_data_ptr_")


@dataclass
class Held:
    """A storage and the distinct tensors found viewing it."""

    storage: torch.UntypedStorage
    tensors: list[torch.Tensor]

    def uncollected_views(self) -> int:
        """Tensors that view the storage but were not found: its use count less the found
        tensors and the storage's own Python object."""
        return torch._C._storage_Use_Count(self.storage._cdata) - 1 - len(self.tensors)


def mode() -> str:
    """"swap" or "set": `COLOCATE_REPOINT` if set, else "swap" where torch has it."""
    chosen = os.environ.get(REPOINT_ENV) or ("swap" if has_swap() else "set")
    if chosen not in ("swap", "set"):
        raise ValueError(f"{REPOINT_ENV}={chosen!r}: use 'swap' or 'set'.")
    if chosen == "swap" and not has_swap():
        raise ValueError(f"{REPOINT_ENV}=swap, but torch {torch.__version__} has no "
                         "UntypedStorage._swap_data_ptr_ (torch 2.12 adds it); use 'set'.")
    return chosen


def complete(held: list[Held], tag: str) -> None:
    """In "set" mode, add to each `Held` the other tensor objects that view its storage, and
    raise before anything moves if views that no Python object holds remain."""
    if mode() == "swap":
        return
    short = {h.storage._cdata: h for h in held if h.uncollected_views() > 0}
    if short:
        for obj in gc.get_objects():
            if not issubclass(type(obj), torch.Tensor):
                continue
            try:
                h = short.get(obj.untyped_storage()._cdata)
            except Exception:  # wrapper subclasses and meta tensors have no storage
                continue
            if h is not None and all(obj is not t for t in h.tensors):
                h.tensors.append(obj)
    for h in short.values():
        left = h.uncollected_views()
        if left > 0:
            raise TagConflictError(
                f"adopt(..., {tag!r}): a storage of {h.storage.nbytes()} bytes is viewed by "
                f"{left} tensor(s) that no Python object holds (saved by autograd for a "
                "backward, a gradient bucket of DDP...). On torch "
                f"{torch.__version__} (no UntypedStorage._swap_data_ptr_, added in torch "
                "2.12) adopt re-points tensor objects, and those views would keep the old "
                "memory, untagged. Adopt before the backward or the wrapper takes them, or "
                "use torch >= 2.12."
            )


def as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def move(held: Held, target: torch.UntypedStorage) -> torch.UntypedStorage:
    """Copy `held`'s bytes into `target` (same size) and make its tensors use them; returns
    the storage that holds the memory now (the old one after a swap, `target` after set)."""
    as_bytes(target).copy_(as_bytes(held.storage))
    if mode() == "swap":
        held.storage._swap_data_ptr_(target)
        return held.storage
    with torch.no_grad():
        for tensor in held.tensors:
            tensor.set_(target, tensor.storage_offset(), tensor.size(), tensor.stride())
    return target
