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
