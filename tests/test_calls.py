"""An endpoint's declaration (`colocate.needs`, `colocate.preemptible`) is read back from
its actor class, through the wrapping `TenantActor` gives every endpoint."""

from __future__ import annotations

import pytest
from monarch.actor import endpoint

from colocate import TenantActor, needs, preemptible
from colocate.calls import CallSpec, call_spec


class Declared(TenantActor):
    stages = {"weights": True, "kv_cache": False}

    @endpoint
    @needs("weights", "kv_cache")
    @preemptible
    def generate(self, n: int) -> int:
        return n

    @endpoint
    @preemptible
    @needs("weights")
    def score(self) -> None:
        return None

    @endpoint
    def plain(self) -> None:
        return None


def test_declarations_are_read_from_the_class_in_either_order() -> None:
    assert call_spec(Declared, "generate") == CallSpec(("weights", "kv_cache"), True)
    assert call_spec(Declared, "score") == CallSpec(("weights",), True)


def test_an_undeclared_endpoint_needs_every_stage_and_is_not_preemptible() -> None:
    assert call_spec(Declared, "plain") == CallSpec(None, False)
    assert call_spec(Declared, "sleep") == CallSpec(None, False)


def test_bad_declarations_are_refused_with_the_cause() -> None:
    with pytest.raises(ValueError, match="at least one stage"):
        needs()
    with pytest.raises(ValueError, match="as strings"):
        needs("weights", 3)  # type: ignore[arg-type]
    with pytest.raises(AttributeError, match="no endpoint 'nothing'"):
        call_spec(Declared, "nothing")


def test_a_bound_is_declared_per_endpoint_and_checked():
    from colocate import bounded

    class Slow(TenantActor):
        @endpoint
        @bounded(2)
        @needs("state")
        def train(self) -> None:
            return None

    assert call_spec(Slow, "train") == CallSpec(("state",), False, 2.0)
    assert call_spec(Declared, "generate").timeout_s is None  # the service's bound
    for bad in (0, -1, "5", True):
        with pytest.raises(ValueError, match="seconds > 0"):
            bounded(bad)  # type: ignore[arg-type]
