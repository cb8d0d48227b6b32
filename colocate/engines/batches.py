"""Batches across the process boundary: a batch reaches an engine unpickled on CPU, and a
result leaves it for the caller's process. `to_device` moves the tensors of a batch, in
nested dicts, lists and tuples, to the engine's device (the trainer's and the reference's
`step`/`forward`), and their results back to CPU (a CUDA tensor sent to the caller would
allocate on the caller's GPU, outside every memory tag)."""

from __future__ import annotations

from typing import Any

import torch


def to_device(batch: Any, device: torch.device | str) -> Any:
    """`batch` with every tensor in it (in nested dicts, lists and tuples) on `device`;
    anything else as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, list | tuple):
        moved = [to_device(item, device) for item in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch
