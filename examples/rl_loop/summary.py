"""The run's summary: the dict a finished run returns and writes to metrics.json
(`summary`), so that a run can be judged, and runs compared, without reading every step.

It is built from the steps' rows and what the loop knows of the run: the evaluations
before and after training, the mean step time, the share of it spent switching
(`switch_share`: (switch_s + sync_s) / step_s), where each service ran, the respawns and
restarts, the task's own figures and, with a reference, its share and the memory per proc.
"""

from __future__ import annotations

from typing import Any

from examples.rl_loop.memory import ProcPeaks


def summarize(steps: list[dict[str, Any]], *, engine: str, devices: dict[str, Any],
              generator_respawns: int, resumed_at: int | None, restarts: int,
              task: dict[str, Any], peaks: ProcPeaks | None, budget: dict[str, Any]
              ) -> dict[str, Any]:
    """The summary of a run whose rows are `steps` (the first: the untrained evaluation);
    `peaks`, the procs' memory peaks, only for a run with a reference (grpo.beta > 0);
    `budget`, the slots' policy and capacity (`budget.budget_summary`), joined by the bytes
    the switches copied per step (out to host memory and back in) and the most a slot held."""
    first, *steps = steps
    step_s = sum(s["step_s"] for s in steps)
    summary = {
        "untrained_eval_reward": first["eval_reward"],
        "final_eval_reward": steps[-1]["eval_reward"],
        "mean_step_s": step_s / len(steps),
        "switch_share": sum(s["switch_s"] + s["sync_s"] for s in steps) / step_s,
        "engine": engine,
        "devices": devices,  # where each service ran: "cpu", or its GPUs' UUIDs
        "generator_respawns": generator_respawns,
        "resumed_at": resumed_at,
        "restarts": restarts,
        **task,
        **budget,
        "bytes_moved_per_step": sum(s.get("copied_out_bytes", 0) + s.get("copied_in_bytes", 0)
                                    for s in steps) / len(steps),
        "slot_peak_bytes": max((s.get("slot_peak_bytes", 0) for s in steps), default=0),
    }
    if peaks is not None:
        # the reference's turn: its forward pass and the one more switch it takes
        summary["reference_share"] = sum(s["reference_s"] + s["reference_switch_s"]
                                         for s in steps) / step_s
        summary["memory_per_proc"] = peaks.summary(budget["policy"] == "budget",
                                                   budget["slot_capacity_bytes"])
    return summary
