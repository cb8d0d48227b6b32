"""Which device a tag's memory is on, and the check that keeps a tag's CUDA memory on the
current device (torch_memory_saver tags only the current device's allocations)."""

from __future__ import annotations

import torch

from colocate.memory.errors import TagConflictError


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`device` (default: CUDA if present, else CPU), with a CUDA index: the current one
    when none is given."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_cuda_device(tag: str, device: torch.device, current: int,
                      tag_index: int | None) -> None:
    """Refuse memory for `tag` on a CUDA device other than the `current` one (it would land
    untagged: torch_memory_saver tags only the current device's allocations; in torch mode
    its memory pool is the current device's), or other than the tag's own (`tag_index`)."""
    if device.type != "cuda":
        return
    if device.index != current:
        raise TagConflictError(
            f"memory for tag {tag!r} on {device}, but the current CUDA device is "
            f"cuda:{current}: torch_memory_saver tags only the current device's allocations "
            f"(the rest would land untagged). Call torch.cuda.set_device({device.index}) "
            "first."
        )
    if tag_index not in (None, device.index):
        raise TagConflictError(
            f"tag {tag!r} has memory on cuda:{tag_index}; it cannot take memory on {device} "
            "too (a resume checks and maps one device). Use one tag per device."
        )
