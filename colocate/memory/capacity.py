"""A CPU slot's capacity, enforced where tagged memory grows: the CPU stand-in for a GPU
running out of memory. A CPU proc has no capacity of its own; the arbiter gives its
tenants their slot's (`ArbiterConfig.slot_capacity_bytes`, through `set_capacity`), and a
`region()` or `adopt()` that would take the process's resident tagged memory past it is
refused with `SlotOutOfMemoryError` before anything is tagged, as a CUDA allocation
would be. On CUDA the device itself refuses."""

from __future__ import annotations

import re

from colocate.memory.errors import SlotOutOfMemoryError

_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_SIZE = r"([\d.]+) (B|KiB|MiB|GiB|TiB)"


class Capacity:
    """The process's slot capacity in bytes (None: not enforced)."""

    def __init__(self) -> None:
        self.bytes: int | None = None

    def check(self, held: int, asked: int, what: str) -> None:
        """Refuse `asked` more bytes for `what` when `held` are resident already."""
        if self.bytes is None or held + asked <= self.bytes:
            return
        free = max(0, self.bytes - held)
        raise SlotOutOfMemoryError(
            f"{what}: {asked} bytes asked but only {free} of the slot's {self.bytes} are "
            "free: make room (sleep another tenant, or declare more working memory) and "
            "try again", asked, free)


def from_cuda_oom(err: BaseException) -> SlotOutOfMemoryError:
    """torch's CUDA out-of-memory error as a `SlotOutOfMemoryError`, with the bytes its
    message gives ("Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of
    which 1.23 GiB is free."); 0 for a figure it does not give."""
    text = str(err)

    def figure(pattern: str) -> int:
        found = re.search(pattern, text)
        return int(float(found.group(1)) * _UNITS[found.group(2)]) if found else 0

    return SlotOutOfMemoryError(text.splitlines()[0] if text else "CUDA out of memory",
                                figure(r"Tried to allocate " + _SIZE),
                                figure(r"of which " + _SIZE + r" is free"))
