"""What the arbiter is told: `ArbiterConfig` (its policy, how strict and how patient),
validated once. What it knows of each slot is in slot.py."""

from __future__ import annotations

from dataclasses import dataclass

from colocate.arbiter.errors import ArbiterError
from colocate.arbiter.policy import POLICIES, Policy
from colocate.checks import check_choice, check_int, check_number


class ArbiterConfigError(ArbiterError, ValueError):
    """An ArbiterConfig field of the wrong type or out of range, named in the message."""


@dataclass(frozen=True)
class ArbiterConfig:
    """How strict and how patient the arbiter is. Validated here, once: each field's type
    (numbers finite, byte counts ints), then its range."""

    policy: str | Policy = "exclusive"  # a name in POLICIES, or a policy object
    release_fraction: float = 0.9  # of a sleeper's resident bytes, measured back
    release_timeout_s: float = 10.0
    request_timeout_s: float = 300.0
    call_timeout_s: float = 120.0  # one message to a proc: a plan, or a describe
    min_verified_bytes: int = 1 << 20  # smaller releases are below measurement noise
    # the budget policy's capacity per slot: required on CPU slots; on a GPU, a cap below
    # the device's own
    slot_capacity_bytes: int | None = None
    headroom_bytes: int = 0  # budget policy: kept free beyond what a wake needs
    # a switch with preemption: how long a tenant's running preemptible calls may take to
    # return what they have before the switch fails, naming it
    preempt_timeout_s: float = 30.0
    # the host's memory for the backups of sleeping stages (host_budget.py); None: what the
    # host has available when the arbiter starts (the cgroup's limit, else MemAvailable)
    host_capacity_bytes: int | None = None
    backup_dir: str | None = None  # backups that the host has no room for go to disk here
    # (None: $COLOCATE_BACKUP_DIR, else the temp dir)

    def __post_init__(self) -> None:
        policy = None if isinstance(self.policy, Policy) \
            else check_choice("policy", self.policy, POLICIES)
        for problem in (
                policy and f"{policy}, or an object that answers what "
                "colocate.arbiter.policy.Policy asks",
                check_number("release_fraction", self.release_fraction, above=0, at_most=1),
                *(check_number(name, getattr(self, name), above=0) for name in (
                    "release_timeout_s", "request_timeout_s", "call_timeout_s",
                    "preempt_timeout_s")),
                check_int("min_verified_bytes", self.min_verified_bytes, 0),
                check_int("slot_capacity_bytes", self.slot_capacity_bytes, 1, optional=True),
                check_int("headroom_bytes", self.headroom_bytes, 0),
                check_int("host_capacity_bytes", self.host_capacity_bytes, 0, optional=True),
                None if self.backup_dir is None or isinstance(self.backup_dir, str)
                else f"backup_dir={self.backup_dir!r}: give a directory's path or None"):
            if problem:
                raise ArbiterConfigError(f"ArbiterConfig.{problem}")

    def make_policy(self) -> Policy:
        """The policy object: built from its class in `POLICIES`, or the one given."""
        if isinstance(self.policy, str):
            return POLICIES[self.policy].from_config(self)
        return self.policy
