"""Errors of the arbiter; each message says who is awake where after the failure."""


class ArbiterError(RuntimeError):
    """Base class of the arbiter's errors."""


class SwitchError(ArbiterError):
    """A sleep or wake failed; the slot was brought back to a consistent state (see message)."""


class ReleaseNotVerifiedError(SwitchError):
    """A tenant was put to sleep but the measured memory did not come back in time."""


class ArbiterTimeoutError(ArbiterError):
    """A request waited longer than its timeout for a slot, or a tenant call did not answer."""
