"""Telemetry of memory time-sharing: memory readings, the pause/resume timeline, leak tracking.

>>> from colocate.telemetry import leak_tracker, read
>>> after = read("cpu")  # or "cuda:0", right after pausing a tag
>>> leak_tracker().observe("generator", after.used_bytes)
"""

from colocate.telemetry.leaks import LeakTracker, ResidualGrowthWarning, leak_tracker
from colocate.telemetry.readings import (
    DEVICE_WIDE_TOLERANCE_BYTES,
    MemoryReading,
    TelemetryError,
    device_uuid,
    process_rss,
    process_runs,
    process_share,
    read,
    read_cpu,
    read_gpu,
    read_gpu_process,
    read_gpu_uuid,
    read_gpu_uuid_process,
    read_pid,
)
from colocate.telemetry.timeline import SwitchEvent, Timeline, timeline

__all__ = [
    "DEVICE_WIDE_TOLERANCE_BYTES",
    "LeakTracker",
    "MemoryReading",
    "ResidualGrowthWarning",
    "SwitchEvent",
    "TelemetryError",
    "Timeline",
    "device_uuid",
    "leak_tracker",
    "process_rss",
    "process_runs",
    "process_share",
    "read",
    "read_cpu",
    "read_gpu",
    "read_gpu_process",
    "read_gpu_uuid",
    "read_gpu_uuid_process",
    "read_pid",
    "timeline",
]
