"""The arbiter: per-host time-sharing of slot memory between colocated tenants.

`core.SlotArbiter` holds the logic and runs without Monarch; `actor.Arbiter` is the
per-host Monarch actor around it; `tenant` is the protocol tenants follow.
"""

from colocate.arbiter.core import ArbiterConfig, SlotArbiter
from colocate.arbiter.errors import (
    ArbiterError,
    ArbiterTimeoutError,
    ReleaseNotVerifiedError,
    SwitchError,
    TenantLostError,
)
from colocate.arbiter.policy import Budget, Exclusive
from colocate.arbiter.tenant import TaggedTenant, TenantHandle, TenantInfo

__all__ = [
    "ArbiterConfig", "ArbiterError", "ArbiterTimeoutError", "Budget", "Exclusive",
    "ReleaseNotVerifiedError", "SlotArbiter", "SwitchError", "TaggedTenant", "TenantHandle",
    "TenantInfo", "TenantLostError",
]
