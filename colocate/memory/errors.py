"""Errors raised by the tagged-memory layer.

Every error is raised in Python before anything reaches a backend, so the process stays
usable (torch_memory_saver itself calls exit(1) on a bad transition).
"""


class TaggedMemoryError(RuntimeError):
    """Base class of all errors of `colocate.memory`."""


class UnknownTagError(TaggedMemoryError):
    """The tag was never given memory through `region()` or `adopt()` in this process."""


class TagStateError(TaggedMemoryError):
    """A transition that the tag's current state does not allow (pause of a paused tag...)."""


class TagPausedError(TagStateError):
    """The tag's memory is paused: its tensors must not be used or extended until resume."""


class TagConflictError(TaggedMemoryError):
    """Memory claimed by two tags, a changed backup policy, or nested regions."""


class CudaSetupError(TaggedMemoryError):
    """The process was not started in a way the CUDA backend (torch_memory_saver) can work in."""


class ResumeOutOfMemoryError(TaggedMemoryError):
    """The device has too little free memory to resume the tag; it stays paused (retry)."""


class SlotOutOfMemoryError(TaggedMemoryError):
    """A tenant asked for more memory than its slot has free: on CPU, its tags would pass
    the slot's capacity (`memory.set_capacity`); on CUDA, the device ran out. Nothing of the
    failed allocation was kept; the caller may make room and try again."""

    def __init__(self, message: str, asked_bytes: int, free_bytes: int) -> None:
        super().__init__(message)
        self.asked_bytes, self.free_bytes = asked_bytes, free_bytes

    def __reduce__(self) -> tuple:  # keeps its fields across processes
        return type(self), (str(self), self.asked_bytes, self.free_bytes)
