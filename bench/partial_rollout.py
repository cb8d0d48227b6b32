"""Partial rollouts against sync on the long-tail task: the RL loop run with
`rollout.mode=sync` and `rollout.mode=partial`, same seed, same model, interleaved A B B A.

The model is the tiny Llama of `examples/rl_loop/long_tail.yaml`, first fitted for a few
seconds to copy digit strings (teacher forcing, `warm_start`): RL starts from a model that
ends its answers, as it would from an SFT checkpoint, so completion lengths follow the
task's long tail (most short, a few of up to 25 tokens) from the first step. A random model
writes 25 tokens almost every time, and then no step has a tail to cut.

Per arm (each twice; the two runs of an arm give the same rewards, seeded, and differ only
in their timing): samples finished per second (trained samples / the steps' wall time),
the generation's idle share (the share of decoded row-steps spent on rows already ended,
`gen_idle_share`), where the step time goes, and the eval reward along the cumulative
samples and along the cumulative step time; the gaps (sync minus partial) are read at the
same number of samples and at the same time, the shorter arm's end, by linear interpolation
between evaluations.

    .venv/bin/python -m bench.partial_rollout [--steps 60] [--engine vllm] [--out FILE]

`--engine vllm` runs both arms on vLLM's CPU engine over 2 slots (one replica a slot).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import announce
from examples.rl_loop import task
from examples.rl_loop.config import load_config
from examples.rl_loop.grpo import pack_batch, supervised_step
from examples.rl_loop.runtime import model_dir

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "rl_loop" / "long_tail.yaml"
# the figures's settings, both arms: one update per batch (TRL's default), evaluated often
COMMON = ["grpo.updates_per_batch=1", "run.save_every=0", "run.resume=none"]
# partial: the next step's first round generated while one trains (rollout.overlap)
ARMS = {"sync": [], "partial": ["rollout.overlap=true"]}
ENGINES = {"torch": [], "vllm": ["run.engine=vllm", "run.slots=2"]}
SPANS = ("generate_s", "score_s", "train_s", "switch_s", "sync_s", "save_s")


def warm_start(work: Path, steps: int, seed: int = 0) -> Path:
    """The long-tail config's tiny model, fitted `steps` AdamW steps to copy the task's
    strings (the answer and eos after each prompt), written to `work/base_model`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = load_config(CONFIG)
    path = model_dir(cfg, work)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed + 1)
    for _ in range(steps):
        prompts = task.sample_prompts(cfg.task, 32, rng)
        ids = [tokenizer(p).input_ids for p in prompts]
        answers = [tokenizer(task.answer(p), add_special_tokens=False).input_ids
                   + [tokenizer.eos_token_id] for p in prompts]
        input_ids, targets, mask = pack_batch(ids, answers, tokenizer.pad_token_id)
        supervised_step(model, optimizer, input_ids, targets, mask)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def run_arm(mode: str, model: Path, out: Path, steps: int, eval_every: int,
            engine: list[str]) -> dict[str, Any]:
    """One run of the loop (its own process); its metrics.json, and its wall time."""
    command = [sys.executable, "-m", "examples.rl_loop", "--config", str(CONFIG),
               f"model.path={model}", f"rollout.mode={mode}", *ARMS[mode], f"run.steps={steps}",
               f"run.eval_every={eval_every}", f"run.out={out}", *COMMON, *engine]
    began = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.monotonic() - began
    if done.returncode:
        raise RuntimeError(f"{mode} run failed: {done.stderr.strip().splitlines()[-1:]}")
    metrics = json.loads((out / "metrics.json").read_text())
    metrics["wall_s"] = wall
    return metrics


def curve(steps: list[dict[str, Any]], along: str) -> list[tuple[float, float]]:
    """(cumulative samples or step seconds, eval reward) at each evaluation, from (0,
    the untrained eval)."""
    points, total = [(0.0, steps[0]["eval_reward"])], 0.0
    for row in steps[1:]:
        total += row["finished_samples"] if along == "samples" else row["step_s"]
        if "eval_reward" in row:
            points.append((total, row["eval_reward"]))
    return points


def at(points: list[tuple[float, float]], x: float) -> float:
    """The curve's value at `x`, linearly between its points."""
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """An arm's figures over its runs: throughput and spans averaged, the eval curves (the
    same in every run of the arm: seeded) with the mean step times."""
    rows = [run["steps"][1:] for run in runs]
    samples = sum(r["finished_samples"] for r in rows[0])
    step_s = [sum(r["step_s"] for r in run) for run in rows]
    mean_s = sum(step_s) / len(step_s)
    spans = {name: sum(sum(r[name] for r in run) for run in rows) / len(rows) / mean_s
             for name in SPANS}
    slots = [r["gen_idle_share"] for r in rows[0]]
    evals = curve(runs[0]["steps"], "samples")
    timed = [(t * mean_s / step_s[0], y) for t, y in curve(runs[0]["steps"], "time")]
    return {"samples": samples, "step_s_total": step_s, "samples_per_s": samples / mean_s,
            "runs_samples_per_s": [samples / s for s in step_s],
            "wall_s": [run["wall_s"] for run in runs], "share_of_step_time": spans,
            "gen_idle_share": sum(slots) / len(slots),
            "mean_step_s": mean_s / len(rows[0]),
            "final_eval_reward": runs[0]["steps"][-1]["eval_reward"],
            "eval_by_samples": evals, "eval_by_time": timed,
            "carried_samples_mean": sum(r.get("carried_samples", 0) for r in rows[0])
            / len(rows[0]),
            "staleness_max": max(r.get("staleness_max", 0) for r in rows[0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="GRPO steps per run")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--warm-steps", type=int, default=150, help="the copy fit's steps")
    parser.add_argument("--engine", choices=("torch", "vllm"), default="torch",
                        help="the generator (vllm: 2 slots)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    machine, command = announce()
    with tempfile.TemporaryDirectory(prefix="partial_rollout_") as tmp:
        work = Path(tmp)
        began = time.monotonic()
        model = warm_start(work, args.warm_steps)
        print(f"warm start: {args.warm_steps} copy steps in {time.monotonic() - began:.1f} s")
        runs: dict[str, list[dict[str, Any]]] = {"sync": [], "partial": []}
        for i, mode in enumerate(("sync", "partial", "partial", "sync")):  # A B B A
            metrics = run_arm(mode, model, work / f"{i}_{mode}", args.steps, args.eval_every,
                              ENGINES[args.engine])
            runs[mode].append(metrics)
            rows = metrics["steps"][1:]
            print(f"{mode}: {sum(r['finished_samples'] for r in rows)} samples in "
                  f"{sum(r['step_s'] for r in rows):.1f} s of steps ({metrics['wall_s']:.0f} s "
                  f"wall), final eval {metrics['steps'][-1]['eval_reward']:.3f}", flush=True)
    sync, partial = summary(runs["sync"]), summary(runs["partial"])
    same_samples = min(sync["samples"], partial["samples"])
    same_time = min(sync["eval_by_time"][-1][0], partial["eval_by_time"][-1][0])
    result = {
        "machine": machine, "command": command, "config": str(CONFIG), "common": COMMON,
        "steps": args.steps, "warm_steps": args.warm_steps, "engine": args.engine,
        "samples_per_s_ratio": partial["samples_per_s"] / sync["samples_per_s"],
        "eval_gap_same_samples": at(sync["eval_by_samples"], same_samples)
        - at(partial["eval_by_samples"], same_samples),
        "eval_gap_same_time": at(sync["eval_by_time"], same_time)
        - at(partial["eval_by_time"], same_time),
        "same_samples": same_samples, "same_time_s": same_time,
        "sync": sync, "partial": partial}
    print(json.dumps({k: v for k, v in result.items() if k not in ("sync", "partial")},
                     indent=1))
    for name, arm in (("sync", sync), ("partial", partial)):
        print(f"{name}: {arm['samples_per_s']:.1f} samples/s, idle share "
              f"{arm['gen_idle_share']:.2f}, step {arm['mean_step_s'] * 1e3:.0f} ms: "
              + ", ".join(f"{k[:-2]} {v:.2f}" for k, v in arm["share_of_step_time"].items()))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
