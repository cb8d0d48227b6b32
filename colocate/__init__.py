"""torch-colocate: trainer/generator colocation with GPU memory time-sharing, on Monarch.

    from colocate import ArbiterConfig, ResourceRequest, TenantActor, init, phase
    rm = await init(scheduler="local", gpus_per_host=8)
    ...
    async with phase("generator"):
        ...

Layers: `memory` (tagged pause/resume per process), `telemetry` (readings, timeline),
`arbiter` (per-host time-sharing of slots), `resources` (hosts, groups, the manager),
`phases` (the switch as a block: `phase`), `calls` (what an endpoint needs: `needs`,
`preemptible`), `testing` (fixtures for your own integration tests).
Importing this package stays light: Monarch loads with `init` and `phase`.

`remote_errors()` makes the runtime's own errors catchable by their type around a direct
actor call (Monarch wraps them in `ActorError`); a spawn that fails raises `SpawnError`.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module that defines it, imported on first use (Monarch loads with these)
_EXPORTS = {
    "init": "colocate.resources.start",
    "phase": "colocate.phases",
    "TenantActor": "colocate.arbiter.actor",
    "ResourceRequest": "colocate.resources.packing",
    "ArbiterConfig": "colocate.arbiter.config",
    "remote_errors": "colocate.arbiter.actor",
    "SpawnError": "colocate.resources.spawning",
    "bounded": "colocate.calls",
    "needs": "colocate.calls",
    "preemptible": "colocate.calls",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'colocate' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
