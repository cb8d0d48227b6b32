"""How a failed step of a request is told: `PlanFailed` (internal: a step of a plan
failed) and the error each kind of request raises for it, naming the step, the cause,
and who is awake where after the rollback."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from colocate.arbiter.errors import ReleaseNotVerifiedError, SwitchError, TenantLostError
from colocate.arbiter.plan import SLEEP, Failure, Step
from colocate.arbiter.slot import Slot


class PlanFailed(Exception):
    """A step of a request's plan failed (internal: the request rolls back and explains)."""

    def __init__(self, failure: Failure, step: Step) -> None:
        super().__init__(failure.cause)
        self.failure, self.step = failure, step


Explain = Callable[[PlanFailed, str], SwitchError]  # (the failure, the rollback's note)


def step_error(slot: Slot, failed: PlanFailed, message: str,
               touched: Iterable[str]) -> SwitchError:
    """The error of a failed step: lost tenants, an unverified release, or a failure."""
    if failed.failure.kind == "lost" or any(n in slot.lost for n in touched):
        return TenantLostError(message, slot.index, tuple(slot.lost))
    if failed.failure.kind == "release":
        return ReleaseNotVerifiedError(message)
    return SwitchError(message)


def switch_error(slot: Slot, waking: str | None) -> Explain:
    """How a failed sleep or wake of a switch is told."""
    def explain(failed: PlanFailed, note: str) -> SwitchError:
        failure, step = failed.failure, failed.step
        not_woken = f"; {waking} was not woken" if waking and step.tenant != waking else ""
        if step.op == SLEEP and failure.kind == "release":
            undone = "it was woken again" if not note else "rolling back failed"
            text = (f"{step.tenant} slept on slot {slot.index} but {failure.cause}; "
                    f"{undone}: {slot.who()}{not_woken}{note}")
        elif step.op == SLEEP:
            text = (f"{step.tenant} failed to sleep on slot {slot.index}: {failure.cause}; "
                    f"{slot.who()}{not_woken}{note}")
        else:
            text = (f"{step.tenant} failed to wake {list(step.stages or ())}: "
                    f"{failure.cause}; rolled back: {slot.who()}{note}")
        return step_error(slot, failed, text, [step.tenant])
    return explain


def raise_errors(results: list, slots: list[Slot]) -> None:
    """Raise the error of a request over several slots, if any failed: one slot's as it
    is; several as one error naming each (every lost tenant named, so that the caller can
    mark them all failed)."""
    errors = [r for r in results if isinstance(r, BaseException)]
    if len(errors) == 1:
        raise errors[0]
    if not errors:
        return
    message = f"{len(errors)} of {len(slots)} slots failed: " + " | ".join(map(str, errors))
    lost = [e for e in errors if isinstance(e, TenantLostError)]
    if lost:
        raise TenantLostError(message, lost[0].slot, tuple(
            dict.fromkeys(name for e in lost for name in e.tenants))) from errors[0]
    raise SwitchError(message) from errors[0]
