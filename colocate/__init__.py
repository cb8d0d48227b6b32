"""torch-colocate: trainer/generator colocation with GPU memory time-sharing, on Monarch.

    from colocate import init, phase
    rm = await init(scheduler="local", gpus_per_host=8)
    ...
    async with phase("generator"):
        ...

Layers: `memory` (tagged pause/resume per process), `telemetry` (readings, timeline),
`arbiter` (per-host time-sharing of slots), `resources` (hosts, groups, the manager),
`phases` (the switch as a block: `phase`), `testing` (fixtures for your own integration tests).
Importing this package stays light: Monarch loads with `init` and `phase`.

`remote_errors()` makes the runtime's own errors catchable by their type around a direct
actor call (Monarch wraps them in `ActorError`); a spawn that fails raises `SpawnError`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SpawnError", "init", "phase", "remote_errors"]


def __getattr__(name: str) -> Any:
    if name == "init":
        from colocate.resources.manager import init

        return init
    if name == "phase":
        from colocate.phases import phase

        return phase
    if name == "remote_errors":
        from colocate.arbiter.actor import remote_errors

        return remote_errors
    if name == "SpawnError":
        from colocate.resources.spawning import SpawnError

        return SpawnError
    raise AttributeError(f"module 'colocate' has no attribute {name!r}")
