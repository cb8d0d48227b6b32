"""`phase(x)`: make a tenant (or a service's tenants) the awake one for a block.

    async with phase("generator"):      # the trainer sleeps on those slots, verified
        rollouts = await generator.generate.call(prompts)

    with phase("trainer"):              # the blocking form, for notebooks and scripts
        ...

    async with phase(trainer.save_checkpoint):   # a service's endpoint: only the stages
        ...                                      # it needs (`colocate.needs`) wake
    async with phase(trainer, preempt=True):     # the generator's running @preemptible
        ...                                      # calls return what they have, at once

On entry the arbiters wake each named tenant in turn, putting to sleep whoever conflicts;
one that cannot wake (its proc died: `TenantLostError`) does not keep the others asleep,
and its error is raised once the others are awake. With `preempt=True` the calls of the
tenants put to sleep that are declared `@preemptible` are not waited for: they are asked
to return what they have (a generator's partial completions, `finished=False`), and a
tenant that does not within `ArbiterConfig.preempt_timeout_s` fails the entry, named
(`PreemptTimeoutError`); other calls drain as ever. On exit nothing moves: the tenant stays
awake until another phase needs its slots, so a repeated phase costs no switch.

The blocking form runs the switch on a helper thread's loop while it holds the caller's. In
Jupyter, where a loop always runs, a call still in flight on that loop (a background task)
cannot finish meanwhile, so the switch waits out the services' `wait_timeout_s` before it
puts that call's tenant to sleep: there, with tasks in the background, use `async with`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from colocate.resources.manager import ResourceManager, current
from colocate.sync_bridge import run_sync


@runtime_checkable
class HasTenants(Protocol):
    """Anything that names the tenants it is made of (a service, for one)."""

    def tenant_names(self) -> list[str]: ...


@runtime_checkable
class HasStages(HasTenants, Protocol):
    """Tenants and the stages a call on them needs (a service's endpoint, for one): None
    for every stage; stages a tenant does not have are not its to wake."""

    def stages(self) -> Sequence[str] | None: ...


# one wake: the tenant, the stages, whether they are a call's needs (see ResourceManager.wake_for)
Wake = tuple[str, Sequence[str] | None, bool]


def _wakes(targets: Sequence[str | HasTenants], stages: list[str] | None) -> list[Wake]:
    wakes: list[Wake] = []
    for target in targets:
        if isinstance(target, str):
            wakes.append((target, stages, False))
        elif isinstance(target, HasStages):
            if stages is not None:
                raise TypeError(f"phase(): {target!r} wakes the stages it needs; stages= "
                                "is for tenant names and services")
            needs = target.stages()
            wakes.extend((name, needs, True) for name in target.tenant_names())
        elif isinstance(target, HasTenants):
            wakes.extend((name, stages, False) for name in target.tenant_names())
        else:
            raise TypeError(f"phase() takes tenant names or objects with tenant_names(), "
                            f"got {target!r}")
    return wakes


class phase:  # noqa: N801 - used like a function, as contextlib's helpers are
    """Wake `targets` (tenant names, or objects with `tenant_names()`) for a block: `stages`
    of them (default: all), or of one with `stages()` (an endpoint), the stages it needs."""

    def __init__(self, *targets: str | HasTenants, stages: list[str] | None = None,
                 rm: ResourceManager | None = None, preempt: bool = False) -> None:
        _wakes(targets, stages)  # a bad target fails here, not at the first entry
        self.targets = targets  # names read at each entry: a respawned replica's is new
        self.stages = stages
        self.rm = rm
        self.preempt = preempt

    async def _enter(self) -> None:
        """Wake each tenant in turn; one that fails does not keep the others asleep: the
        first error is raised once all were tried, noting the others'."""
        rm = self.rm or current()
        failed: list[tuple[str, Exception]] = []
        for name, stages, needs in _wakes(self.targets, self.stages):
            try:
                await (rm.wake_for(name, stages, preempt=self.preempt) if needs else
                       rm.wake(name, None if stages is None else list(stages),
                               preempt=self.preempt))
            except Exception as err:
                failed.append((name, err))
        if failed:
            first = failed[0][1]
            for name, err in failed[1:]:
                first.add_note(f"{name} did not wake either: {type(err).__name__}: {err}")
            raise first

    async def __aenter__(self) -> phase:
        await self._enter()
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def __enter__(self) -> phase:
        run_sync(self._enter())
        return self

    def __exit__(self, *exc: object) -> None:
        return None
