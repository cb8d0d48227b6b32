"""The arbiter: per-host time-sharing of slot memory between colocated tenants.

`core.SlotArbiter` decides (per-slot order, the cross-tenant view, rollback) and runs
without Monarch; `config` holds its settings and `slot` its per-slot state; a switch is a
`plan` per proc, carried out where the memory is (`delivery` sends it and reads the answer,
or runs it step by step for the tenants of the arbiter's own process, `local`'s handles;
`handoff` builds the trainer-to-generator one, `undo` rolls a failed one back);
`host.Arbiter` is the per-host Monarch actor around it and `actor.TenantActor` the
tenants' base class, which runs plans; `preempt` is how a switch stops a running call
early; `policy` answers its questions (who sleeps, who may share a slot); `tenant` is the
protocol tenants follow.
"""

from colocate.arbiter.config import ArbiterConfig
from colocate.arbiter.core import SlotArbiter
from colocate.arbiter.errors import (
    ArbiterError,
    ArbiterTimeoutError,
    PreemptTimeoutError,
    ReleaseNotVerifiedError,
    SwitchAbortedError,
    SwitchError,
    TenantLostError,
)
from colocate.arbiter.policy import Budget, Exclusive, Policy
from colocate.arbiter.tenant import TaggedTenant, Tenancy, TenantHandle, TenantInfo

__all__ = [
    "ArbiterConfig", "ArbiterError", "ArbiterTimeoutError", "Budget", "Exclusive", "Policy",
    "PreemptTimeoutError", "ReleaseNotVerifiedError", "SlotArbiter", "SwitchAbortedError",
    "SwitchError", "TaggedTenant", "Tenancy", "TenantHandle", "TenantInfo", "TenantLostError",
]
