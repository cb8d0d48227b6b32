"""Where a step's time went: a clock for a GRPO step's phases, which gives the figures each
step's row carries (`generate_s`, `switch_s`, `step_s`, ...), so a run shows what its
switches cost beside generating and training.

The step calls `lap(span)` as each part of it ends; the time since the last lap (or the
clock's start) goes to that span, summed over the step, so every moment of the step is in
exactly one span and the figures add up to the step's wall time.
"""

from __future__ import annotations

import time

# The spans, each a `<span>_s` figure of the row (`generator_switch`, `reference_switch` and
# `switch`, the trainer's, together make `switch_s`); "readings" are the memory readings
# taken for the plots, timed apart.
SPANS = ("generator_switch", "readings", "generate", "score", "reference_switch", "reference",
         "switch", "train", "save", "sync")


class StepClock:
    """One step's clock, started when it is made."""

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.spans = dict.fromkeys(SPANS, 0.0)

    def lap(self, span: str) -> None:
        """The time since the last lap (or the start) was `span`'s."""
        if span not in self.spans:
            raise ValueError(f"no span {span!r}: one of {', '.join(SPANS)}")
        now = time.monotonic()
        self.spans[span] += now - self.last
        self.last = now

    def metrics(self, switch_ahead_s: float) -> dict[str, float]:
        """The step's time figures:

        - `generate_s`, `score_s`, `reference_s`, `train_s`, `save_s`, `sync_s`: each phase's
          own time (`reference_s` 0 without a reference);
        - `switch_s`: the time the step waited for switches (the generator's wake, the
          reference's and the trainer's: what was left of the switch started ahead);
          `generator_switch_s` and `reference_switch_s`, the generator's and the
          reference's parts of it;
        - `switch_ahead_s`: the switch started ahead's own duration (given);
        - `step_s`: the step's wall time, its readings left out;
        - `readings_s`: the memory readings, the last one (after the sync) included.
        """
        s = self.spans
        return {"generate_s": s["generate"], "score_s": s["score"],
                "reference_s": s["reference"], "reference_switch_s": s["reference_switch"],
                "generator_switch_s": s["generator_switch"],
                "train_s": s["train"], "save_s": s["save"],
                "switch_s": s["generator_switch"] + s["reference_switch"] + s["switch"],
                "switch_ahead_s": switch_ahead_s, "sync_s": s["sync"],
                "step_s": sum(v for name, v in s.items() if name != "readings"),
                "readings_s": s["readings"]}
