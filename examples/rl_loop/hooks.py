"""The moments of a run where a caller may look or act: a benchmark injecting faults, a
test killing a proc at a chosen phase. Subclass `Hooks`, override what you need, and give
it to the loop: `Loop(cfg, hooks=MyHooks())`. Each default does nothing but what it wraps,
so a run with the plain `Hooks` is the run itself.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

PHASES = ("start", "generate", "reference", "train", "sync")  # `Hooks.phase`'s labels


class Hooks:
    """What a run calls at each of its moments."""

    loop: Any  # the run's `loop.Loop`, set by it (typed loosely: the loop imports this)

    async def started(self) -> None:
        """The runtime and the services are up: the trainer loaded, the generator synced."""

    async def step_began(self, index: int) -> None:
        """Step `index` begins (again, after a restart that went back to it)."""

    async def phase(self, label: str) -> None:
        """The run enters phase `label` (one of `PHASES`): after its memory readings and,
        in a step, right before that phase's calls."""

    async def save(self, done: int, save: Callable[[], Awaitable[dict[str, Any]]]
                   ) -> dict[str, Any]:
        """The trainer's save after its `done`-th step, the trainer awake (`save()` saves
        when `run.save_every` says so); returns what the step's row notes of it."""
        return await save()

    async def sync(self, sync: Callable[[], Awaitable[Any]]) -> None:
        """A step's weight sync, trainer to generator (`sync()` runs it)."""
        await sync()

    async def step_ended(self, index: int, row: dict[str, Any]) -> None:
        """Step `index` ended with its metrics `row`."""

    async def loading(self, checkpoint: Path | None) -> None:
        """After a restart of the slots, before the trainer loads `checkpoint` (None: none
        yet: it keeps the weights it started with)."""

    async def stopping(self) -> None:
        """The run is about to shut its runtime down (ended or failed)."""
