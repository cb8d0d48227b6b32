"""What a tenant's endpoint declares about its calls: the stages a call needs awake, and
whether a switch may stop it early.

    class Generator(TenantActor):
        stages = {"weights": True, "kv_cache": False}

        @endpoint
        @needs("weights", "kv_cache")
        @preemptible
        def generate(self, prompts): ...

        @endpoint
        @bounded(600)
        def train(self, batch): ...            # a call past 600 s: its replica is hung

        @endpoint
        def describe_model(self): ...          # undeclared: needs every stage

The service layer routes a call only to a replica whose needed stages are awake, and
`phase(service, endpoint=...)`-style wakes bring up only those; the arbiter's budget
policy keeps everything else where it is when it fits. A preemptible call may be asked
to return what it has when a switch needs its slot (the tenant's `preempt` hook). Both
declarations go under `@endpoint`, in either order; they are read from the actor class
by `call_spec`, never from a name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from colocate.monarch_compat import EndpointProperty, endpoint_function

F = TypeVar("F", bound=Callable[..., Any])
_ATTRIBUTE = "__colocate_call__"


@dataclass(frozen=True)
class CallSpec:
    """An endpoint's declaration: `stages` it needs awake (None: every stage of the
    tenant), whether a switch may preempt it, and how long a call of it may take before its
    replica counts as hung (None: the service's `call_timeout_s`)."""

    stages: tuple[str, ...] | None = None
    preemptible: bool = False
    timeout_s: float | None = None


def _declare(fn: F, **fields: Any) -> F:
    spec = getattr(fn, _ATTRIBUTE, CallSpec())
    setattr(fn, _ATTRIBUTE, replace(spec, **fields))
    return fn


def needs(*stages: str) -> Callable[[F], F]:
    """Declare the stages an endpoint's calls need awake (put it under `@endpoint`)."""
    if not stages or not all(isinstance(s, str) and s for s in stages):
        raise ValueError(f"needs{stages!r}: name at least one stage, as strings")
    return lambda fn: _declare(fn, stages=tuple(dict.fromkeys(stages)))


def preemptible(fn: F) -> F:
    """Declare that a switch may ask an endpoint's calls to return early with what they
    have (put it under `@endpoint`)."""
    return _declare(fn, preemptible=True)


def bounded(seconds: float) -> Callable[[F], F]:
    """Declare how long an endpoint's call may take (put it under `@endpoint`): one that
    does not answer by then counts as a hung replica (see `ServiceConfig.call_timeout_s`)."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds <= 0:
        raise ValueError(f"bounded({seconds!r}): give a number of seconds > 0")
    return lambda fn: _declare(fn, timeout_s=float(seconds))


def call_spec(actor_class: type, endpoint: str) -> CallSpec:
    """What `actor_class`'s endpoint `endpoint` declared (the default when nothing)."""
    prop = getattr(actor_class, endpoint, None)
    if not isinstance(prop, EndpointProperty):
        raise AttributeError(f"{actor_class.__name__} has no endpoint {endpoint!r}")
    return getattr(endpoint_function(prop), _ATTRIBUTE, CallSpec())
