"""Does a run do what its plan said? The RL loop on CPU at 3 model sizes x 3 slot capacities
x 1 and 2 slots, each planned first (`examples.rl_loop.plan.make_plan`, nothing started),
then run for a few steps; per run the plan's figures beside the run's and the signed
relative errors, (predicted - measured) / measured: `bytes_moved_error` (copied to host
memory and back per step, from the second step on), `switch_time_error` (switch + sync
time per step), `peak_slot_error` (the most a slot held after a switch),
`peak_host_error` (the loop process's peak RSS and the most the backups held), against
`colocate.planning.TARGETS` (1%, 25%, 10%, 15%). At each size, the exclusive 1-slot run
again with a host budget for its backups (`run.host_memory`) of 3/4 of what they held:
`host_capacity_bytes`, `peak_host_bytes` (the most its backups held in host memory; the
rest went to disk) and whether its rewards equal the unconstrained run's.

Capacities per size, from the tenants' estimated sizes (`examples.rl_loop.calibrate.
capacities`): "ample" (twice what all hold), "tight" (`run.slot_memory=auto`'s),
"exclusive" (the largest tenant alone, with 1% to spare). The calibration's runs are of
other sizes than 256x4 and 512x4 (its fit's points: the default size, 64x4 and 384x4), so
those rows are predictions of what was not measured, 512x4 beyond it. First the machine's
switch costs are calibrated (python -m examples.rl_loop --calibrate, into a rates file of
the bench's own) unless `--rates FILE` names one.

    .venv/bin/python -m bench.plan [--steps 15] [--rates FILE] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import announce
from colocate.planning import check, load_rates
from examples.rl_loop import task
from examples.rl_loop.calibrate import calibrate_switches, capacities
from examples.rl_loop.config import load_config
from examples.rl_loop.plan import make_plan, model_config, predicted

SIZES = {"64x2": [],
         "256x4": ["model.hidden_size=256", "model.layers=4", "model.heads=4",
                   "model.kv_heads=2", "model.intermediate_size=1024"],
         "512x4": ["model.hidden_size=512", "model.layers=4", "model.heads=8",
                   "model.kv_heads=2", "model.intermediate_size=2048"]}
SLOTS = (1, 2)


def run_one(overrides: list[str], rates_file: Path, out: Path) -> dict[str, Any]:
    """Plan the run of `overrides`, run it, and hold its figures against the plan."""
    cfg = load_config(overrides=[*overrides, f"run.rates={rates_file}"])
    plan = make_plan(cfg, model_config(cfg, task.ALPHABET), load_rates(rates_file)).as_dict()
    command = [sys.executable, "-m", "examples.rl_loop", f"run.out={out}",
               f"run.rates={rates_file}", *overrides]
    began = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr[-2000:]}")
    metrics = json.loads((out / "metrics.json").read_text())
    ran = metrics["summary"]["plan"]
    measured = {k: ran[k]["measured"] for k in ("bytes_moved", "switch_time", "peak_slot",
                                                 "peak_host")}
    checked = check(predicted(plan), measured)
    row = {f"{k}_error": checked[k]["error"] for k in measured}
    row.update({f"predicted_{k}": checked[k]["predicted"] for k in measured})
    row.update({f"measured_{k}": v for k, v in measured.items()})
    summary = metrics["summary"]
    row.update(fits=plan["fits"], off=checked["off"], run_s=time.monotonic() - began,
               same_plan_as_run=json.loads((out / "plan.json").read_text())["predicted"]
               == plan["predicted"], peak_host_bytes=summary["host/peak_backup_bytes"],
               peak_disk_backup_bytes=summary["host/peak_disk_backup_bytes"],
               rewards=[s.get("reward") for s in metrics["steps"]])
    return row


def host_budget_row(unconstrained: dict[str, Any], overrides: list[str], rates_file: Path,
                    out: Path) -> dict[str, Any]:
    """The run of `unconstrained` again with the host's backup budget (`run.host_memory`)
    3/4 of what its backups held: its peak against that capacity, and whether its rewards
    are the unconstrained run's."""
    capacity = max(1, unconstrained["peak_host_bytes"] * 3 // 4)
    row = run_one([*overrides, f"run.host_memory={capacity}"], rates_file, out)
    return {**row, "host_capacity_bytes": capacity,
            "same_rewards_as_unconstrained": row["rewards"] == unconstrained["rewards"]}


def report(row: dict[str, Any]) -> None:
    host = (f"; backups {row['peak_host_bytes']} B of {row['host_capacity_bytes']} B, "
            f"{row['peak_disk_backup_bytes']} B on disk, same rewards "
            f"{row['same_rewards_as_unconstrained']}" if "host_capacity_bytes" in row else "")
    print(f"{row['size']:6} {row['capacity']:9} {row['slots']} slot(s): errors bytes "
          f"{row['bytes_moved_error']:+.4f}, switch {row['switch_time_error']:+.3f}, slot "
          f"{row['peak_slot_error']:+.4f}, host {row['peak_host_error']:+.4f}{host} "
          f"({row['run_s']:.0f} s)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--rates", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    machine, command = announce()
    results: dict[str, Any] = {"machine": machine, "command": command, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rates_file = args.rates
        if rates_file is None:
            rates_file = work / "rates.json"
            began = time.monotonic()
            results["calibration"] = calibrate_switches(str(rates_file))
            results["calibration"]["seconds"] = time.monotonic() - began
            print(f"calibrated in {results['calibration']['seconds']:.0f} s: "
                  f"{results['calibration']['fixed_s']}", flush=True)
        results["rates"] = vars(load_rates(rates_file))
        for size, model in SIZES.items():
            for name, capacity in capacities(model).items():
                for slots in SLOTS:
                    overrides = [*model, f"run.slot_memory={capacity}", f"run.slots={slots}",
                                 f"run.steps={args.steps}", f"run.eval_every={args.steps}",
                                 "run.save_every=0", "run.resume=none"]
                    out = work / f"{size}-{name}-{slots}"
                    row = {"size": size, "capacity": name, "capacity_bytes": capacity,
                           "slots": slots,
                           **run_one(overrides, rates_file, out)}
                    results["runs"].append(row)
                    report(row)
                    if name == "exclusive" and slots == 1 and row["peak_host_bytes"]:
                        row = {"size": size, "capacity": "exclusive, host budget",
                               "capacity_bytes": capacity, "slots": slots,
                               **host_budget_row(row, overrides, rates_file, Path(f"{out}-host"))}
                        results["runs"].append(row)
                        report(row)
    rows = results["runs"]
    results["worst"] = {key: max(abs(r[key]) for r in rows) for key in (
        "bytes_moved_error", "switch_time_error", "peak_slot_error", "peak_host_error")}
    text = json.dumps(results, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(json.dumps(results["worst"], indent=2))


if __name__ == "__main__":
    main()
