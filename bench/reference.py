"""The reference model's cost: the RL loop without and with it (`grpo.beta`), side by side.

For each layout (1 slot; 2 slots with FSDP), the same config and seed run four times, in
the order A B B A (so a machine that slows or warms over time weighs on both alike):
`grpo.beta=0` (A: trainer and generator) and `grpo.beta=--beta` (B: the reference, a third
tenant woken once a step for the reference log-probs). Printed per layout:

- step time without and with the reference (means over both runs of each, steps after the
  first, which builds the optimizer state) and their ratio;
- the reference's turn: its switch in (`reference_switch_s`) and its forward pass
  (`reference_s`), in seconds and as a share of the step;
- per proc, the peak of what the three tenants held together at a phase switch against
  max(trainer, generator) + the reference's weights (`memory_per_proc`, worst proc).

    python -m bench.reference [--steps 10] [--beta 0.1] [--out runs/bench_reference/results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path

from bench.common import announce
from examples.rl_loop.config import load_config
from examples.rl_loop.loop import Loop

LAYOUTS = {"1 slot": ["run.slots=1"], "2 slots, fsdp": ["run.slots=2", "trainer.parallel=fsdp"]}


async def one_run(out: Path, steps: int, overrides: list[str]) -> dict:
    cfg = load_config(overrides=[f"run.out={out}", f"run.steps={steps}",
                                 f"run.eval_every={steps}", "run.resume=none",
                                 "run.save_every=0", *overrides])
    summary = await Loop(cfg).run()
    rows = json.loads((out / "metrics.json").read_text())["steps"]
    return {"summary": summary, "steps": [r for r in rows if r["step"] >= 1]}


def mean(rows: list[dict], key: str) -> float:
    return statistics.mean(r.get(key, 0.0) for r in rows)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--out", default="runs/bench_reference/results.json")
    args = parser.parse_args()
    info, command = announce()
    out = Path(args.out)
    results = {"machine": info, "command": command, "layouts": {}}
    for layout, overrides in LAYOUTS.items():
        runs: dict[float, list[dict]] = {0.0: [], args.beta: []}
        for i, beta in enumerate((0.0, args.beta, args.beta, 0.0)):
            runs[beta].append(await one_run(
                out.parent / f"{layout.replace(' ', '_').replace(',', '')}_{i}", args.steps,
                [*overrides, f"grpo.beta={beta}"]))
        plain = [row for run in runs[0.0] for row in run["steps"]]
        ref = [row for run in runs[args.beta] for row in run["steps"]]
        step_plain, step_ref = mean(plain, "step_s"), mean(ref, "step_s")
        turn = mean(ref, "reference_switch_s") + mean(ref, "reference_s")
        memory = runs[args.beta][-1]["summary"]["memory_per_proc"]
        row = {"step_s_without": step_plain, "step_s_with": step_ref,
               "ratio": step_ref / step_plain,
               "reference_switch_s": mean(ref, "reference_switch_s"),
               "reference_forward_s": mean(ref, "reference_s"),
               "reference_turn_share": turn / step_ref, **memory}
        results["layouts"][layout] = row
        print(f"\n{layout}: step {step_plain:.3f} s without the reference, {step_ref:.3f} s "
              f"with (x{row['ratio']:.2f}); its turn {turn * 1e3:.1f} ms "
              f"(switch {row['reference_switch_s'] * 1e3:.1f} + forward "
              f"{row['reference_forward_s'] * 1e3:.1f}) = {row['reference_turn_share']:.3f} "
              f"of a step")
        print(f"  per proc (worst of {memory['procs']}): peak {memory['peak_bytes'] / 2**20:.2f} "
              f"MiB <= bound {memory['bound_bytes'] / 2**20:.2f} MiB (max(trainer, generator) "
              f"+ reference {memory['reference_bytes'] / 2**20:.2f} MiB): "
              f"{'ok' if memory['within_bound'] else 'EXCEEDED'}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    asyncio.run(main())
