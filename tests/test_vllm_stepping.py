"""`EngineStepper` (colocate/engines/vllm_stepping.py) when the engine fails: a step that
raises (what a broken vLLM engine does, which a test cannot cause for real) answers every
call in flight with its error, nothing waits, and the next call is stepped again."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from colocate.engines.vllm_stepping import Call, EngineStepper


@dataclass
class Output:
    request_id: str
    finished: bool


class FlakyEngine:
    """Finishes every request at the step after it was added; its first step raises."""

    def __init__(self) -> None:
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.steps = 0

    def add_request(self, rid: str, prompt: object, params: object) -> None:
        self.added.append(rid)

    def step(self) -> list[Output]:
        self.steps += 1
        if self.steps == 1:
            raise RuntimeError("engine core died")
        done, self.added = self.added, []
        return [Output(rid, True) for rid in done]

    def abort_request(self, rids: list[str]) -> None:
        self.aborted += rids


def test_a_failed_step_answers_every_call_and_the_next_call_is_served():
    engine = FlakyEngine()
    gate = threading.Condition()
    stepper = EngineStepper(engine, "test-steps", gate, lambda call: sorted(call.outputs), 1)
    first, second = Call([("a", None, None)], None), Call([("b", None, None)], None)
    with gate:
        stepper.add(first)
        stepper.add(second)
    for call in (first, second):
        with pytest.raises(RuntimeError, match="engine core died"):
            call.future.result(timeout=10)
    assert set(engine.aborted) >= {"a"} and not stepper.running and not stepper.driving
    later = Call([("c", None, None)], None)
    with gate:
        stepper.add(later)
    assert later.future.result(timeout=10) == ["c"]
