"""`python -m examples.rl_loop --calibrate`: what a switch costs on this machine beyond its
bytes, and how much memory the loop's process takes, measured on two short runs of the
loop at its default size and kept in the rates file (`colocate.planning.Rates.fixed_s`,
`process_bytes`).

A tight run (`run.slot_memory=auto`: the trainer's wake and the sync go through the
arbiter) and an ample one (every wake has nothing to do, the sync is an in-place copy), on
1 slot and on 2, `STEPS` steps each. From the second step on, each way's fixed cost is the
median of what its switch took less what its bytes take at the calibrated rates (the run's
own plan says which bytes): "wake" and "sync" from the tight runs, "none" and "in_place"
from the ample ones; what the second slot adds, per way, is the difference. The process's
peak is the larger of the two 1-slot runs'.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from colocate.planning import Rates, cached_rates, default_path, load_rates

STEPS = 8
RUNS = {f"{name}, {slots} slots": [capacity, f"run.slots={slots}"] for slots in (1, 2)
        for name, capacity in (("tight", "run.slot_memory=auto"),
                               ("ample", "run.slot_memory=1GiB"))}


def calibrate_switches(path: str | None = None) -> dict[str, Any]:
    """Measure and keep this machine's fixed switch costs and the loop's process peak in
    the rates file `path` (default: this machine's); returns what was written."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = Path(path) if path else default_path(device)
    rates = load_rates(target) if target.exists() else cached_rates(device, target)
    bare = dataclasses.replace(rates, fixed_s={})  # bytes only
    fixed: dict[tuple[str, int], list[float]] = {}  # (way, slots) -> seconds
    process = 0
    with tempfile.TemporaryDirectory() as tmp:
        for index, overrides in enumerate(RUNS.values()):
            out = Path(tmp) / str(index)
            command = [sys.executable, "-m", "examples.rl_loop", f"run.out={out}",
                       f"run.steps={STEPS}", f"run.eval_every={STEPS}", "run.save_every=0",
                       "run.resume=none", f"run.rates={target}", *overrides]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"{' '.join(command)} failed: {done.stderr[-2000:]}")
            metrics = json.loads((out / "metrics.json").read_text())
            plan = json.loads((out / "plan.json").read_text())
            slots = plan["slots_per_host"]
            for way, seconds in switch_costs(metrics["steps"][2:], plan, bare).items():
                fixed.setdefault((way, slots), []).extend(seconds)
            if slots == 1:
                process = max(process, metrics["summary"]["plan"]["measured_process_bytes"])
    median = {key: max(0.0, statistics.median(s)) for key, s in fixed.items()}
    fixed_s = {way: s for (way, slots), s in median.items() if slots == 1}
    per_slot = {way: max(0.0, median.get((way, 2), s) - s) for way, s in fixed_s.items()}
    rates = rates.with_fixed(fixed_s, per_slot, process)
    rates.save(target)
    return {"rates_file": str(target), "fixed_s": fixed_s, "fixed_per_slot_s": per_slot,
            "process_bytes": process}


def switch_costs(steps: list[dict[str, Any]], plan: dict[str, Any], bare: Rates
                 ) -> dict[str, list[float]]:
    """Per way, each step's measured switch time less its bytes' time: the trainer's wake
    (started ahead: its own duration) and the sync, as slot 0's plan has them."""
    switches = {s["turn"]: s for s in plan["slots"][0]["step"]}
    found: dict[str, list[float]] = {}
    for turn, figure in (("wake trainer", "switch_ahead_s"),
                         ("sync trainer -> generator", "sync_s")):
        switch = switches[turn]
        way = switch["way"] if switch["way"] != "arbiter" else turn.split()[0]
        moved = bare.seconds(way, switch["copied_out"], switch["copied_in"],
                             switch["discarded"], switch["refilled"], switch["in_slot_bytes"])
        found.setdefault(way, []).extend(step[figure] - moved for step in steps)
    return found

