"""ServiceConfig: the shape of a service and how it routes, heals and scales.

All validation happens here, in one place, before anything is spawned: each field's type
(ints are ints, not bools or floats; numbers are finite), then its range, then how the fields
fit together; every error names the field, the value and what to give instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from colocate.checks import check_bool, check_choice, check_int, check_name, check_number

ROUTERS = ("round_robin", "least_loaded")  # each keeps sessions: services.router
WHEN_ASLEEP = ("wait", "wake", "fail")
RESTARTS = ("replica", "group")


class ServiceConfigError(ValueError):
    """A ServiceConfig that cannot be served, with the field and the limit in the message."""


@dataclass(frozen=True)
class ServiceConfig:
    """How many replicas, where they run, and how calls reach them.

    A replica spans `hosts_per_replica` hosts x `procs_per_host` procs (`procs_per_replica`
    is the one-host shorthand). Services naming the same `resource_group` share procs.

    `restart` says what comes back when a replica fails (with `respawn`): "replica" (that
    replica alone, on new procs for its slots) or "group" (every service of its resource
    group, on new procs for every slot, in spawn order; see `services.restart`). Every
    service of a group has the same policy.
    """

    num_replicas: int = 1
    min_replicas: int | None = None  # default: num_replicas
    max_replicas: int | None = None  # default: num_replicas
    hosts_per_replica: int = 1
    procs_per_host: int | None = None
    procs_per_replica: int | None = None
    with_gpus: bool = True
    resource_group: str | None = None  # default: the service's own name
    # routing
    router: str = "round_robin"  # for calls without a session: "round_robin" | "least_loaded"
    when_asleep: str = "wait"
    wait_timeout_s: float = 60.0
    # health
    # a routed call's bound: past it, its replica counts as hung (its procs are killed and
    # it comes back as after a crash); an endpoint may declare its own (`colocate.bounded`)
    call_timeout_s: float = 900.0
    max_retries: int = 2
    respawn: bool = True
    restart: str = "replica"  # "replica" | "group": what is respawned after a failure
    # autoscaling
    scale_up_queue_depth: float = 4.0  # mean in-flight requests per awake replica
    scale_down_utilization: float = 0.1  # mean busy fraction per replica
    scale_cooldown_s: float = 30.0

    def __post_init__(self) -> None:
        def fail(message: str) -> None:
            raise ServiceConfigError(f"ServiceConfig: {message}")

        problems = (
            *(check_int(name, getattr(self, name), 1) for name in (
                "num_replicas", "hosts_per_replica")),
            *(check_int(name, getattr(self, name), 1, optional=True) for name in (
                "min_replicas", "max_replicas", "procs_per_host", "procs_per_replica")),
            check_int("max_retries", self.max_retries, 0),
            *(check_bool(name, getattr(self, name)) for name in ("with_gpus", "respawn")),
            check_name("resource_group", self.resource_group, optional=True),
            check_choice("router", self.router, ROUTERS),
            check_choice("when_asleep", self.when_asleep, WHEN_ASLEEP),
            check_choice("restart", self.restart, RESTARTS),
            *(check_number(name, getattr(self, name), above=0) for name in (
                "wait_timeout_s", "call_timeout_s", "scale_cooldown_s",
                "scale_up_queue_depth")),
            check_number("scale_down_utilization", self.scale_down_utilization, at_least=0,
                         below=1),
        )
        for problem in problems:
            if problem:
                fail(problem)
        if self.procs_per_host is not None and self.procs_per_replica is not None:
            fail("give procs_per_host or procs_per_replica (the one-host shorthand), not both")
        if self.procs_per_replica is not None and self.hosts_per_replica != 1:
            fail(f"procs_per_replica is for one-host replicas; hosts_per_replica="
                 f"{self.hosts_per_replica}: use procs_per_host instead")
        if self.restart == "group" and not self.respawn:
            fail("restart='group' restarts the group's services after a failure, but "
                 "respawn=False says never respawn: give restart='replica' with respawn=False, "
                 "or leave respawn=True")
        if self.restart == "group" and self.min != self.max:
            fail(f"restart='group' restarts a group of a fixed shape, but min_replicas="
                 f"{self.min} and max_replicas={self.max} ask for autoscaling: give "
                 "num_replicas alone for restart='group'")
        if self.min > self.max:
            fail(f"min_replicas={self.min} is above max_replicas={self.max}")
        if not self.min <= self.num_replicas <= self.max:
            fail(f"num_replicas={self.num_replicas} is outside [min_replicas={self.min}, "
                 f"max_replicas={self.max}]")

    @property
    def procs(self) -> int:
        """Procs per host of one replica."""
        if self.procs_per_replica is not None:
            return self.procs_per_replica
        return 1 if self.procs_per_host is None else self.procs_per_host

    @property
    def min(self) -> int:
        return self.num_replicas if self.min_replicas is None else self.min_replicas

    @property
    def max(self) -> int:
        return self.num_replicas if self.max_replicas is None else self.max_replicas

    def check_fits(self, num_hosts: int, gpus_per_host: int) -> None:
        """Refuse a shape that no host layout could hold (before anything is spawned)."""
        if self.hosts_per_replica > num_hosts:
            raise ServiceConfigError(
                f"ServiceConfig: hosts_per_replica={self.hosts_per_replica} is above the "
                f"{num_hosts} host(s) there are")
        if self.with_gpus and self.procs > gpus_per_host:
            raise ServiceConfigError(
                f"ServiceConfig: procs_per_host={self.procs} is above the {gpus_per_host} "
                "GPUs of a host")
