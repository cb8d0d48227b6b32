"""The arbiter: per-host time-sharing of slot memory between colocated tenants.

`core.SlotArbiter` holds the logic and runs without Monarch; `actor.Arbiter` is the
per-host Monarch actor around it; `policy` answers its questions (who sleeps, who may
share a slot); `tenant` is the protocol tenants follow.
"""

from colocate.arbiter.core import ArbiterConfig, SlotArbiter
from colocate.arbiter.errors import (
    ArbiterError,
    ArbiterTimeoutError,
    ReleaseNotVerifiedError,
    SwitchAbortedError,
    SwitchError,
    TenantLostError,
)
from colocate.arbiter.policy import Budget, Exclusive, Policy
from colocate.arbiter.tenant import TaggedTenant, Tenancy, TenantHandle, TenantInfo

__all__ = [
    "ArbiterConfig", "ArbiterError", "ArbiterTimeoutError", "Budget", "Exclusive", "Policy",
    "ReleaseNotVerifiedError", "SlotArbiter", "SwitchAbortedError", "SwitchError",
    "TaggedTenant", "Tenancy", "TenantHandle", "TenantInfo", "TenantLostError",
]
