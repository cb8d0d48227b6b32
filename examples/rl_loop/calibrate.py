"""`python -m examples.rl_loop --calibrate`: what a switch costs on this machine beyond the
memory layer's raw rates, and how much memory the loop's process takes, measured on short
runs of the loop and kept in the rates file (`colocate.planning.Rates`: `fixed_s`,
`byte_scale` and their per-slot growth, `process_bytes`).

A switch's time is a fixed cost per way (its messages, the release checks, the view's
bookkeeping) plus its bytes, which in a real switch cost more than a lone copy of one
64 MiB tag does (many tensors, pages faulted in again, the slots' procs sharing the
machine's memory bandwidth). So each way is fitted as `fixed + scale x (its bytes' time at
the calibrated rates)`, a line through runs that move few bytes and many: the loop at two
model sizes (`SIZES`), each with slots ample (every wake has nothing to do, the sync is an
in-place copy: "none" and "in_place"), exclusive (every switch goes through the arbiter
and copies whole tenants out and back: "wake" and "sync") and, at the default size, tight
(`run.slot_memory=auto`: the budget policy's handoffs, through the arbiter too), on 1 slot
and on 2. Each run is a point: its median step's switch time beside its bytes' time, from
the third step on. What a second slot adds to the fixed cost and to the scale (one
arbiter a host carries out every slot's switch, and their copies share the memory) is the
difference between the 2-slot fit and the 1-slot one. The process's peak is the largest of
the 1-slot runs'.
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
from examples.rl_loop import task
from examples.rl_loop.budget import auto_capacity, tenant_sizes
from examples.rl_loop.config import load_config
from examples.rl_loop.plan import model_config

STEPS = 10
# the model sizes the fit's points come from: the default, and one that moves ~25x more
SIZES = {"64x2": [],
         "192x4": ["model.hidden_size=192", "model.layers=4", "model.heads=4",
                   "model.kv_heads=2", "model.intermediate_size=768"]}
POLICIES = {"64x2": ("ample", "exclusive", "tight"), "192x4": ("ample", "exclusive")}


def capacities(overrides: list[str]) -> dict[str, int]:
    """A model size's slot capacities: "ample" (twice what all its tenants hold), "tight"
    (`run.slot_memory=auto`'s), "exclusive" (the largest tenant alone, with 1% to spare)."""
    cfg = load_config(overrides=overrides)
    sizes = tenant_sizes(cfg, model_config(cfg, task.ALPHABET), rank=None)
    totals = [size.total for size in sizes.values()]
    return {"ample": 2 * sum(totals), "tight": auto_capacity(sizes),
            "exclusive": int(1.01 * max(totals))}


def calibrate_switches(path: str | None = None) -> dict[str, Any]:
    """Measure and keep this machine's switch costs and the loop's process peak in the rates
    file `path` (default: this machine's); returns what was written."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = Path(path) if path else default_path(device)
    rates = load_rates(target) if target.exists() else cached_rates(device, target)
    bare = dataclasses.replace(rates, fixed_s={}, fixed_per_slot_s={}, byte_scale={},
                               byte_scale_per_slot={})  # bytes only, at the raw rates
    points: dict[tuple[str, int], list[tuple[float, float]]] = {}  # (way, slots) -> runs
    process = 0
    with tempfile.TemporaryDirectory() as tmp:
        for size, model in SIZES.items():
            chosen = capacities(model)
            for policy in POLICIES[size]:
                for slots in (1, 2):
                    out = Path(tmp) / f"{size}-{policy}-{slots}"
                    metrics, plan = _run(out, target, [*model, f"run.slots={slots}",
                                                       f"run.slot_memory={chosen[policy]}"])
                    for way, point in switch_points(metrics["steps"][2:], plan, bare).items():
                        points.setdefault((way, slots), []).append(point)
                    if slots == 1:
                        process = max(process,
                                      metrics["summary"]["plan"]["measured_process_bytes"])
    fits = {key: fit_line(found) for key, found in points.items()}
    one = {way: fit for (way, slots), fit in fits.items() if slots == 1}
    two = {way: fits.get((way, 2), fit) for way, fit in one.items()}
    rates = rates.with_fixed(
        {way: fit[0] for way, fit in one.items()},
        {way: max(0.0, two[way][0] - fit[0]) for way, fit in one.items()}, process,
        byte_scale={way: fit[1] for way, fit in one.items()},
        byte_scale_per_slot={way: max(0.0, two[way][1] - fit[1]) for way, fit in one.items()})
    rates.save(target)
    return {"rates_file": str(target), "fixed_s": rates.fixed_s,
            "fixed_per_slot_s": rates.fixed_per_slot_s, "byte_scale": rates.byte_scale,
            "byte_scale_per_slot": rates.byte_scale_per_slot, "process_bytes": process,
            "points": {f"{way}, {slots} slot(s)": found
                       for (way, slots), found in sorted(points.items())}}


def _run(out: Path, rates_file: Path, overrides: list[str]) -> tuple[dict, dict]:
    """A short run of the loop: its metrics and its plan."""
    command = [sys.executable, "-m", "examples.rl_loop", f"run.out={out}",
               f"run.steps={STEPS}", f"run.eval_every={STEPS}", "run.save_every=0",
               "run.resume=none", f"run.rates={rates_file}", *overrides]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr[-2000:]}")
    return (json.loads((out / "metrics.json").read_text()),
            json.loads((out / "plan.json").read_text()))


def switch_points(steps: list[dict[str, Any]], plan: dict[str, Any], bare: Rates
                  ) -> dict[str, tuple[float, float]]:
    """Per way, one run's point: (its bytes' time at the raw rates, the median step's
    measured time), for the trainer's wake (started ahead: its own duration) and the sync,
    as slot 0's plan has them."""
    switches = {s["turn"]: s for s in plan["slots"][0]["step"]}
    found: dict[str, tuple[float, float]] = {}
    for turn, figure in (("wake trainer", "switch_ahead_s"),
                         ("sync trainer -> generator", "sync_s")):
        switch = switches[turn]
        way = switch["way"] if switch["way"] != "arbiter" else turn.split()[0]
        moved = bare.seconds(way, switch["copied_out"] - switch.get("to_disk", 0),
                             switch["copied_in"] - switch.get("from_disk", 0),
                             switch["discarded"], switch["refilled"], switch["in_slot_bytes"],
                             to_disk=switch.get("to_disk", 0),
                             from_disk=switch.get("from_disk", 0))
        found[way] = (moved, statistics.median(step[figure] for step in steps))
    return found


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(fixed, scale) of the least-squares line `measured = fixed + scale x bytes' time`
    through `points`; where the bytes' times barely differ (a way that moves nothing), the
    scale is 1 and the fixed cost the median of what is left. Neither is below 0."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread <= (1e-4 * max(1e-3, mean_x)) ** 2 * len(xs):
        return max(0.0, statistics.median(y - x for x, y in points)), 1.0
    scale = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in points) / spread)
    return max(0.0, mean_y - scale * mean_x), scale
