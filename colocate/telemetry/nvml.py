"""NVML, initialised once per process and shut down at exit, for both of its users: GPU
discovery (`colocate.resources.gpus`) and memory readings (`colocate.telemetry.readings`).

Probed once, as vLLM's `cumem_available`: absent (no pynvml, no NVML library, no driver
loaded) is `None`, meaning no GPUs; any other failure of `nvmlInit` is an `NvmlError` that
names NVML's error, never taken for "no GPUs".
"""

from __future__ import annotations

import atexit
import functools
from types import ModuleType


class NvmlError(RuntimeError):
    """NVML is there but failed (no permission, a GPU lost...): the message names the call
    and NVML's error."""


@functools.cache
def nvml() -> ModuleType | None:
    """pynvml, initialised for this process; None where NVML is absent."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        if err.value in (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
                         pynvml.NVML_ERROR_DRIVER_NOT_LOADED):
            return None
        raise NvmlError(f"nvmlInit failed: {err}") from err
    atexit.register(pynvml.nvmlShutdown)
    return pynvml
