"""The hosts' memory for backups: `run.host_memory` and `run.backup_dir` as the arbiter's
fields, each step's reading of what the hosts' backups held so far, and the run's summary
of it.

Each host's arbiter counts the backups of its sleeping stages against its capacity and
keeps the peak its procs measured (`colocate.arbiter.host_budget`); a step's row has the
peak so far over the hosts (`host_backup_peak_bytes`, `host_disk_backup_peak_bytes`), the
summary the run's: `host/peak_backup_bytes` (the most host memory the backups of one host
held at once, measured in its procs), `host/peak_disk_backup_bytes`, and
`host_capacity_bytes` (the smallest host's capacity for them).
"""

from __future__ import annotations

from typing import Any

from colocate.resources.manager import ResourceManager
from examples.rl_loop.budget import parse_bytes
from examples.rl_loop.config import RunConfig


def host_fields(run: RunConfig) -> dict[str, Any]:
    """`ArbiterConfig`'s host fields for `run` (None: auto, as the arbiter measures it)."""
    return {"host_capacity_bytes": None if run.host_memory == "auto"
            else parse_bytes(run.host_memory),
            "backup_dir": run.backup_dir or None}


async def host_readings(rm: ResourceManager) -> dict[str, int]:
    """What the hosts' backups held at most so far (a step's row: the same for the same
    seed, so the capacity, measured at start when auto, is not in it)."""
    hosts = (await rm.host_memory()).values()
    return {"host_backup_peak_bytes": max(h["peak_backup_bytes"] for h in hosts),
            "host_disk_backup_peak_bytes": max(h["peak_disk_backup_bytes"] for h in hosts)}


async def host_capacity(rm: ResourceManager) -> int:
    """The smallest host's capacity for backups."""
    return min(h["host_capacity_bytes"] for h in (await rm.host_memory()).values())


def host_summary(steps: list[dict[str, Any]], capacity: int | None) -> dict[str, int | None]:
    """The run's figures (see module) from its steps' rows and the hosts' capacity."""
    rows = [row for row in steps if "host_backup_peak_bytes" in row]
    if not rows:
        return {}
    return {"host/peak_backup_bytes": max(r["host_backup_peak_bytes"] for r in rows),
            "host/peak_disk_backup_bytes": max(r["host_disk_backup_peak_bytes"] for r in rows),
            "host_capacity_bytes": capacity}
