"""Errors of the arbiter; each message says who is awake where after the failure."""


class ArbiterError(RuntimeError):
    """Base class of the arbiter's errors."""


class SwitchError(ArbiterError):
    """A sleep or wake failed; the slot was brought back to a consistent state (see message)."""


class ReleaseNotVerifiedError(SwitchError):
    """A tenant was put to sleep but the measured memory did not come back in time."""


class TenantLostError(SwitchError):
    """A tenant's proc died: it and the other tenants of that proc on the slot hold nothing
    and cannot be woken again (the message says which, when, and what to do). `slot` and
    `tenants` (every lost tenant of that slot) say it to code."""

    def __init__(self, message: str, slot: int | None = None,
                 tenants: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.slot, self.tenants = slot, tuple(tenants)

    def __reduce__(self) -> tuple:  # the fields survive the trip back from the arbiter
        return type(self), (str(self), self.slot, self.tenants)


class SwitchAbortedError(ArbiterError):
    """The runtime shut down while a switch was under way (or before it began)."""


class PreemptTimeoutError(SwitchError):
    """A switch asked with preemption found a tenant's preemptible call still running when
    `ArbiterConfig.preempt_timeout_s` ran out; the switch did not happen (nothing moved, the
    call runs on). `tenant` names it."""

    def __init__(self, message: str, tenant: str = "") -> None:
        super().__init__(message)
        self.tenant = tenant

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.tenant)


class ArbiterTimeoutError(ArbiterError):
    """A request waited longer than its timeout for a slot, or a tenant call did not answer."""


class UnknownStageError(KeyError):
    """A stage name that the tenant's `stages` do not have (a KeyError, as a lookup)."""

    def __str__(self) -> str:  # KeyError's own would quote the whole message
        return str(self.args[0]) if self.args else ""


class HostMemoryError(SwitchError):
    """A switch's backups fit neither the host's memory for backups nor the backup disk;
    the switch did not happen. `needed` and `free` are the host bytes it asked and had."""

    def __init__(self, message: str, needed: int = 0, free: int = 0) -> None:
        super().__init__(message)
        self.needed, self.free = needed, free

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.needed, self.free)
