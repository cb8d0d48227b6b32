"""Give back memory that allocators keep after it was freed.

A pause releases a tag's memory, but a tenant also leaves memory outside its tags: blocks
it freed (a trainer's activations, a generator's scratch) that the CUDA caching allocator
or glibc's malloc keep for reuse. Held by a sleeping tenant, they crowd the tenant that
wakes. `release_cached()` returns them: `torch.cuda.empty_cache()` on CUDA, glibc's
`malloc_trim(0)` on the host. Memory still in use is untouched. Every pause runs it.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_cached() -> None:
    """Return this process's freed-but-kept allocator memory to the driver and the OS."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
        # safe beside paused tags: torch_memory_saver's regions allocate from memory pools
        # it keeps alive, and empty_cache frees only the default pool and dead pools
        torch.cuda.empty_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
