"""`python -m examples.rl_loop --calibrate`: what a switch costs on this machine beyond the
memory layer's raw rates, and how much memory the loop's process takes, measured on short
runs of the loop and kept in the rates file (`colocate.planning.Rates`: `fixed_s`,
`per_tensor_s`, `byte_scale` and their per-slot growth, `process_bytes`).

A switch's time is a fixed cost per way (its messages, the release checks), a cost per
tensor it handles (each is paused, repointed or copied on its own), and its bytes, which in
a real switch cost more than a lone copy of one 64 MiB tag does (pages faulted in again,
the slots' procs sharing the machine's memory bandwidth). So each way is fitted as `fixed +
per_tensor x tensors + scale x (its bytes' time at the calibrated rates)`, through runs of
the loop at model sizes that vary the tensors and the bytes apart (`SIZES`: twice the
layers at one width, then one layer count at two widths), each with slots ample (every wake
has nothing to do, the sync is an in-place copy: "none" and "in_place"), exclusive (every
switch goes through the arbiter and copies whole tenants out and back: "wake" and "sync")
and, at the default size, tight (`run.slot_memory=auto`: the budget policy's handoffs,
through the arbiter too), on 1 slot and on 2. Each configuration is a point: its median
step's switch time beside its tensors and its bytes' time, from the third step on, the
median of its runs' (`RUNS`: the noisiest made three times); the fit weighs each point by
its own time, so a plan is off by as little as it can be relative to what it predicts, at
every size. What a second slot adds (one arbiter a host carries out every slot's switch,
and their copies share the memory) is fitted with it, through the 1-slot and 2-slot points
at once, as a growth of each term that is never below 0. A backup on disk costs more than
its lone copy too (a file per stage, and bytes that the page cache writes back): the
exclusive 1-slot runs of `DISK_SIZES` are made again with a host budget short of their
backups (`DISK_RUNS` times each, their points' median), and what the fit leaves unexplained
of their switches is fitted as `per_stage x disk stages + out_scale x (their bytes
written's time) + in_scale x (their bytes read back's)`: on this project's CPU machines a
write to a new file costs several times what a calibration's repeated one does, a read back
about what it does. The process's peak is the largest of the 1-slot runs'.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from colocate.planning import Rates, cached_rates, default_path, load_rates
from examples.rl_loop import task
from examples.rl_loop.budget import auto_capacity, tenant_sizes
from examples.rl_loop.config import load_config
from examples.rl_loop.plan import model_config

STEPS = 16
# a run's way: bytes' time, tensors, slots beyond the first, measured seconds
Point = tuple[float, int, int, float]
Fit = tuple[float, float, float]  # fixed seconds, seconds per tensor, byte scale
# a host-budget run's way: bytes written to disk's time, read back's, disk stages, seconds
# left unexplained, measured seconds
DiskPoint = tuple[float, float, int, float, float]
# the model sizes the fit's points come from: the default; twice its layers (as many bytes
# per tensor, twice the tensors); and those layers at a width that moves ~35x more bytes
SIZES = {"64x2": [],
         "64x4": ["model.layers=4"],
         "384x4": ["model.hidden_size=384", "model.layers=4", "model.heads=6",
                   "model.kv_heads=2", "model.intermediate_size=1536"]}
POLICIES = {"64x2": ("ample", "exclusive", "tight"), "64x4": ("ample", "exclusive"),
            "384x4": ("ample", "exclusive")}
# the sizes whose exclusive 1-slot run is made again with a host budget for backups of 3/4
# of what they held (`run.host_memory`), so that what the budget lacks goes to disk
DISK_SIZES = ("64x2", "384x4")
# runs of one configuration, whose points' median the fit takes: a sync in place of a few
# ms and a backup to disk and back vary between runs by 20-40% here (one run in three far
# off), a switch through host memory by about 10%
RUNS = {"ample": 3, "tight": 1, "exclusive": 1}
DISK_RUNS = 3


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
    points: dict[str, list[Point]] = {}  # way -> its runs' points
    to_disk: list[list[tuple[dict, dict]]] = []  # the host-budget runs, by configuration
    process = 0
    with tempfile.TemporaryDirectory() as tmp:
        for size, model in SIZES.items():
            chosen = capacities(model)
            for policy in POLICIES[size]:
                for slots in (1, 2):
                    out = Path(tmp) / f"{size}-{policy}-{slots}"
                    run = [*model, f"run.slots={slots}", f"run.slot_memory={chosen[policy]}"]
                    runs = [_run(Path(f"{out}-{n}"), target, run)
                            for n in range(RUNS[policy])]
                    found = [switch_points(m["steps"][2:], p, bare, slots) for m, p in runs]
                    for way in found[0]:
                        points.setdefault(way, []).append(median([f[way] for f in found]))
                    if slots == 1:
                        process = max(process, *(m["summary"]["plan"]["measured_process_bytes"]
                                                 for m, _ in runs))
                    if slots == 1 and policy == "exclusive" and size in DISK_SIZES:
                        budget = runs[0][0]["summary"]["host/peak_backup_bytes"] * 3 // 4
                        to_disk.append([_run(Path(f"{out}-disk{n}"), target,
                                             [*run, f"run.host_memory={budget}"])
                                        for n in range(DISK_RUNS)])
    fits = {way: fit_switch(found) for way, found in points.items()}
    rates = rates.with_switch_costs({way: one for way, (one, _) in fits.items()},
                                    {way: more for way, (_, more) in fits.items()}, process)
    disk = [median(same) for runs in to_disk for same in zip(
        *(disk_points(m["steps"][2:], p, rates) for m, p in runs), strict=True)]
    rates = dataclasses.replace(rates, **dict(zip(
        ("disk_stage_s", "disk_out_scale", "disk_in_scale"), fit_disk(disk), strict=True)))
    rates.save(target)
    return {"rates_file": str(target), "fixed_s": rates.fixed_s,
            "fixed_per_slot_s": rates.fixed_per_slot_s, "per_tensor_s": rates.per_tensor_s,
            "per_tensor_per_slot_s": rates.per_tensor_per_slot_s,
            "byte_scale": rates.byte_scale, "byte_scale_per_slot": rates.byte_scale_per_slot,
            "disk_stage_s": rates.disk_stage_s, "disk_out_scale": rates.disk_out_scale,
            "disk_in_scale": rates.disk_in_scale,
            "process_bytes": process,
            "points": dict(sorted(points.items())),
            "disk_points": disk}


def median(points: Sequence[tuple]) -> tuple:
    """The median of `points` (runs of one configuration), coordinate by coordinate."""
    return tuple(statistics.median(values) for values in zip(*points, strict=True))


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


def switch_points(steps: list[dict[str, Any]], plan: dict[str, Any], bare: Rates,
                  slots: int) -> dict[str, Point]:
    """Per way, one run's point: (its bytes' time at the raw rates, its tensors, its slots
    beyond the first, the median step's measured time), for the trainer's wake and the
    sync (`_measured`)."""
    found: dict[str, Point] = {}
    for way, switch, took in _measured(steps, plan):
        moved = bare.seconds(way, switch["copied_out"] - switch.get("to_disk", 0),
                             switch["copied_in"] - switch.get("from_disk", 0),
                             switch["discarded"], switch["refilled"], switch["in_slot_bytes"],
                             to_disk=switch.get("to_disk", 0),
                             from_disk=switch.get("from_disk", 0))
        found[way] = (moved, switch["tensors"], slots - 1, took)
    return found


def _measured(steps: list[dict[str, Any]], plan: dict[str, Any]
              ) -> Iterator[tuple[str, dict[str, Any], float]]:
    """The trainer's wake (started ahead: its own duration) and the sync, as slot 0's plan
    has them: each one's way, its planned switch and the median step's measured time."""
    switches = {s["turn"]: s for s in plan["slots"][0]["step"]}
    for turn, figure in (("wake trainer", "switch_ahead_s"),
                         ("sync trainer -> generator", "sync_s")):
        switch = switches[turn]
        way = switch["way"] if switch["way"] != "arbiter" else turn.split()[0]
        yield way, switch, statistics.median(step[figure] for step in steps)


def disk_points(steps: list[dict[str, Any]], plan: dict[str, Any], rates: Rates
                ) -> list[DiskPoint]:
    """A host-budget run's trainer wake and sync: (the time of their bytes written to disk
    and read back at the raw disk rates, their disk stages, what the fitted rates leave
    unexplained of the median step's measured time, that time)."""
    found = []
    for way, switch, took in _measured(steps, plan):
        host = rates.seconds(way, switch["copied_out"] - switch["to_disk"],
                             switch["copied_in"] - switch["from_disk"], switch["discarded"],
                             switch["refilled"], switch["in_slot_bytes"],
                             tensors=switch["tensors"])
        if switch["disk_stages"]:
            found.append((*rates.disk_times(switch["to_disk"], switch["from_disk"]),
                          switch["disk_stages"], took - host, took))
    return found


def fit_disk(points: list[DiskPoint]) -> tuple[float, float | None, float | None]:
    """(seconds per stage on disk, the scale of the bytes written, of those read back) of
    `left = per_stage x stages + out_scale x written + in_scale x read` (their times at
    the raw disk rates) through `points` (`disk_points`), least squares of the error
    relative to each point's time, none below 0; a scale no point measured is None (the
    way's holds); (0, None, None) without points."""
    if not points:
        return 0.0, None, None
    written, read, stages, left, took = (np.array(c, dtype=float)
                                         for c in zip(*points, strict=True))
    columns = {"per_stage": stages}
    columns.update({name: times for name, times in (("out", written), ("in", read))
                    if times.any()})
    found = _fit(columns, left, took)
    return (found.get("per_stage", 0.0), found.get("out", 0.0) if "out" in columns else None,
            found.get("in", 0.0) if "in" in columns else None)


def fit_switch(points: list[Point]) -> tuple[Fit, Fit]:
    """A way's (fixed, per_tensor, scale) on one slot and what each further slot adds to
    each, of `measured = fixed + per_tensor x tensors + scale x bytes' time` (each term
    plus its growth per further slot) through `points` (`switch_points`) of 1 and 2
    slots at once, least squares of the relative error, none below 0: a second slot that
    measured a little faster than the first somewhere adds nothing rather than taking off.
    A term whose value is the same at every point cannot be told from the fixed cost:
    where the tensors do not vary, per_tensor is 0; where the bytes' times barely do (a
    way that moves nothing), the scale is 1; where the slots do not, nothing grows."""
    moved, tensors, more, took = (np.array(column, dtype=float)
                                  for column in zip(*points, strict=True))
    scaled = np.ptp(moved) > 1e-4 * max(1e-3, float(moved.mean()))
    terms = {"fixed": np.ones_like(took)}
    if np.ptp(tensors) > 0:
        terms["per_tensor"] = tensors
    if scaled:
        terms["scale"] = moved
    columns = {(name, 0): column for name, column in terms.items()}
    if np.ptp(more) > 0:
        columns.update({(name, 1): column * more for name, column in terms.items()})
    found = _fit(columns, took - (0.0 if scaled else moved), took)
    one, per_slot = (tuple(found.get((name, grows), 0.0) for name in ("fixed", "per_tensor",
                                                                       "scale"))
                     for grows in (0, 1))
    return (one if scaled else (*one[:2], 1.0)), per_slot


def _fit(columns: dict[Any, np.ndarray], left: np.ndarray, took: np.ndarray
         ) -> dict[Any, float]:
    """The coefficients, none below 0, of the named columns whose sum is closest to
    `left` relative to `took` (least squares of the relative error); a column left out
    has none."""
    weight = 1.0 / np.maximum(took, 1e-9)
    best: tuple[float, dict[Any, float]] = (float(np.sum((left * weight) ** 2)), {})
    for size in range(1, len(columns) + 1):  # each set of terms, their coefficients >= 0
        for names in itertools.combinations(columns, size):
            design = np.stack([columns[n] * weight for n in names], axis=1)
            coefficients = np.linalg.lstsq(design, left * weight, rcond=None)[0]
            if (coefficients < 0).any():
                continue
            residual = float(np.sum((design @ coefficients - left * weight) ** 2))
            if residual < best[0]:
                best = (residual, dict(zip(names, map(float, coefficients), strict=True)))
    return best[1]
