"""What a switch moves under the budget policy: the RL loop at two model sizes, each under
three slot capacities, against the exclusive policy on the same seed.

Capacities, from the tenants' estimated sizes (examples/rl_loop/budget.py): "ample" (twice
what all hold: nothing need sleep), "tight" (`run.slot_memory=auto`'s: they cannot all be
awake; at the default size the trainer's weights must move while the generator works),
"exclusive" (the largest tenant alone, with 1% to spare: the estimate leaves out buffers).
Per run: the bytes copied per step between slot
memory and its host backup (out and in; discarded bytes and in-place syncs do not count)
against the fewest the capacity requires (`required_per_step`), the switch share of the
step time, the most a slot held after a switch against its capacity, and the final eval
reward, which the policy must not change (same seed).

Then the shapes beyond one slot and two tenants (`CASES`: two slots under DDP and FSDP, a
reference, partial rollouts overlapping a tight slot), each at its tight capacity, checked
(`checks`): moved/required within [0.9, 1.05] from the second step on, no slot over its
capacity, and every step's metrics equal to the exclusive policy's run (for the overlap,
which the exclusive policy refuses: to the same run on ample slots).
tests/test_step_budget.py runs the overlap's.

    .venv/bin/python -m bench.budget [--steps 20] [--case-steps 10] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from examples.rl_loop.budget import auto_capacity, tenant_sizes
from examples.rl_loop.config import load_config
from examples.rl_loop.runtime import model_dir

# name -> (overrides, the comparison run's overrides beside them)
CASES = {
    "2 slots, ddp": (["run.slots=2"], ["run.policy=exclusive"]),
    "2 slots, fsdp": (["run.slots=2", "trainer.parallel=fsdp"], ["run.policy=exclusive"]),
    "reference": (["grpo.beta=0.1"], ["run.policy=exclusive"]),
    "partial, overlap": (["rollout.mode=partial", "rollout.overlap=true",
                          "rollout.max_tokens_per_step=3"], ["run.slot_memory=1GiB"]),
}
# a step's figures that depend on time or on the policy, not on what was learned
TIMING = ("_s", "_bytes", "samples_per_s", "slept", "overlap_side_by_side")
SIZES = {"default": [], "256x4": ["model.hidden_size=256", "model.layers=4", "model.heads=4",
                                  "model.kv_heads=2", "model.intermediate_size=1024"]}


def capacities(overrides: list[str], work: Path) -> dict[str, int]:
    """The three capacities for a model size (see module)."""
    cfg = load_config(overrides=overrides)
    sizes = tenant_sizes(cfg, model_dir(cfg, work))
    totals = [size.total for size in sizes.values()]
    return {"ample": 2 * sum(totals), "tight": auto_capacity(sizes),
            "exclusive": int(1.01 * max(totals))}


def run_loop(overrides: list[str], out: Path) -> dict:
    """One run of the RL loop; its metrics.json."""
    command = [sys.executable, "-m", "examples.rl_loop", f"run.out={out}", *overrides]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr[-2000:]}")
    return json.loads((out / "metrics.json").read_text())


def entry(metrics: dict, capacity: int | None) -> dict:
    summary, steps = metrics["summary"], metrics["steps"][1:]
    return {"capacity_bytes": capacity,
            "bytes_moved_per_step": summary["bytes_moved_per_step"],
            "bytes_required_per_step": summary.get("bytes_required_per_step"),
            "bytes_discarded_per_step": sum(s["discarded_bytes"] for s in steps) / len(steps),
            "switch_share": summary["switch_share"],
            "mean_step_s": summary["mean_step_s"],
            "slot_peak_bytes": summary["slot_peak_bytes"],
            "peak_over_capacity_bytes": 0 if capacity is None
            else max(0, summary["slot_peak_bytes"] - capacity),
            "final_eval_reward": summary["final_eval_reward"]}


def learned(metrics: dict) -> list[dict]:
    """Each step's figures apart from its times and its memory traffic."""
    return [{k: v for k, v in row.items() if not k.endswith(TIMING)}
            for row in metrics["steps"]]


def run_case(name: str, steps: int, work: Path) -> dict:
    """Case `name` at its tight capacity (`auto`'s, from the sizes of its slot 0) and its
    comparison run; the figures and the checks that failed (`checks`, empty: all held)."""
    overrides, compared = CASES[name]
    common = [*overrides, f"run.steps={steps}", f"run.eval_every={steps}",
              "run.save_every=0", "run.resume=none"]
    cfg = load_config(overrides=common)
    capacity = auto_capacity(tenant_sizes(cfg, model_dir(cfg, work / "model")))
    tight = run_loop([*common, f"run.slot_memory={capacity}"], work / "tight")
    other = run_loop([*common, *compared], work / "compared")
    found = entry(tight, capacity)
    steady = [s["copied_out_bytes"] + s["copied_in_bytes"] for s in tight["steps"][2:]]
    # from step 1: step 0 starts with the generator awake from the first sync, no turn yet
    ratio = sum(steady) / len(steady) / found["bytes_required_per_step"]
    found.update(moved_over_required=ratio, compared_to=" ".join(compared),
                 same_steps=learned(tight) == learned(other))
    found["checks"] = [failed for failed, bad in (
        (f"moved/required {ratio:.3f} outside [0.9, 1.05]", not 0.9 <= ratio <= 1.05),
        (f"a slot held {found['peak_over_capacity_bytes']} B over its capacity",
         found["peak_over_capacity_bytes"] > 0),
        (f"steps differ from the run with {found['compared_to']}", not found["same_steps"]),
    ) if bad]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--case-steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for size, model in SIZES.items():
            common = [*model, f"run.steps={args.steps}", f"run.eval_every={args.steps}",
                      "run.save_every=0", "run.resume=none"]
            rows = {}
            for name, capacity in capacities(model, work / size).items():
                metrics = run_loop([*common, f"run.slot_memory={capacity}"],
                                   work / size / name)
                rows[name] = entry(metrics, capacity)
                print(f"{size:8} {name:10} capacity {capacity / 2**20:8.2f} MiB: moved "
                      f"{rows[name]['bytes_moved_per_step'] / 2**20:7.3f} MiB/step, required "
                      f"{rows[name]['bytes_required_per_step'] / 2**20:7.3f}, switch share "
                      f"{rows[name]['switch_share']:.3f}, peak over capacity "
                      f"{rows[name]['peak_over_capacity_bytes']} B, eval "
                      f"{rows[name]['final_eval_reward']:.4f}", flush=True)
            exclusive = entry(run_loop([*common, "run.policy=exclusive"], work / size / "ex"),
                              None)
            print(f"{size:8} exclusive policy: moved "
                  f"{exclusive['bytes_moved_per_step'] / 2**20:7.3f} MiB/step, switch share "
                  f"{exclusive['switch_share']:.3f}, eval "
                  f"{exclusive['final_eval_reward']:.4f}", flush=True)
            # the exclusive policy's figures, named apart: no capacity, so nothing required
            results[size] = {"budget": rows, "exclusive_policy": {
                f"exclusive_{k}": v for k, v in exclusive.items() if k not in (
                    "bytes_required_per_step", "capacity_bytes", "peak_over_capacity_bytes")},
                "same_eval_as_exclusive": all(r["final_eval_reward"]
                                              == exclusive["final_eval_reward"]
                                              for r in rows.values())}
        results["cases"] = {}
        for name in CASES:
            case = run_case(name, args.case_steps, work / "cases" / name.replace(" ", ""))
            results["cases"][name] = case
            print(f"{name:16} capacity {case['capacity_bytes'] / 2**20:8.2f} MiB: moved/"
                  f"required {case['moved_over_required']:.3f}, same steps as "
                  f"{case['compared_to']}: {case['same_steps']}, "
                  f"{'; '.join(case['checks']) or 'all checks hold'}", flush=True)
    text = json.dumps(results, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
