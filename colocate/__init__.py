"""torch-colocate: trainer/generator colocation with GPU memory time-sharing, on Monarch.

    from colocate import ArbiterConfig, ResourceRequest, TenantActor, init, phase
    rm = await init(scheduler="local", gpus_per_host=8)
    ...
    async with phase("generator"):
        ...

Layers, top down (docs/architecture.md; tests/test_layers.py checks them): `phases` (the
switch as a block: `phase`) and `testing` (fixtures for your own integration tests);
`engines` (trainer, generators, weight sync) beside `resources` (hosts, groups, the
manager); `arbiter` (per-host time-sharing of slots); `memory` (tagged pause/resume per
process) and `shm_files`; `telemetry` (readings, timeline). Under all: `calls` (what an
endpoint declares: `needs`, `preemptible`, `bounded`), `checks`, `monarch_compat`.
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
