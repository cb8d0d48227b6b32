"""Multi-turn, tool-using rollouts: the tool task learned with one command, and what running
the episodes together buys when tools are slow.

1. The tool task (`examples/rl_loop/tasks/multiply*.py`: products of two 3-digit numbers, a
   calculator tool) trained by the RL loop from its warm start (a model that knows the
   calculator but seldom calls it), as the README's commands run it: the held-out eval
   (`correct`, the final answer's credit) before and after (`untrained_eval_reward`,
   `final_eval_reward`) and the share of episodes that called the tool.
2. With the trained model, `--episodes` held-out episodes with every tool call 50 ms slower
   (the calculator behind a 50 ms wait, as a remote tool), run all at once (one batched
   generate call a turn for every episode still going, their tool calls together) against
   one at a time: samples per second (`samples_per_s_ratio`: at once / one at a time) and
   the generator's busy share (the time inside generate calls / the wall time) for each.
3. On two torch generator replicas with a session KV cache (`generator.session_cache_mb`),
   the same episodes with each episode's turns on its own replica (sticky, as the loop
   runs them) against dealt round robin: the share of the turns' earlier tokens computed
   again instead of taken from the cache (`prefix_recompute_share_sticky`, `_round_robin`).

    .venv/bin/python -m bench.agentic [--steps 60] [--warm-steps 300] [--episodes 32]
                                      [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import announce
from examples.rl_loop.tasks import multiply
from examples.rl_loop.tasks.multiply_warm import warm

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "examples" / "rl_loop" / "tasks"
SLOW_MS = 50

SLOW_TOOL = f'''
import asyncio

from examples.rl_loop.tasks.multiply_tools import calculator as exact


async def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression, after a wait of a remote tool's latency.

    Args:
        expression: the expression, e.g. 123*456
    """
    await asyncio.sleep({SLOW_MS / 1000})
    return exact(expression)
'''


def task_overrides(data: Path, tools: str) -> list[str]:
    """The tool task as the README runs it."""
    return [f"data.train_files={data / 'train.jsonl'}", f"data.eval_files={data / 'eval.jsonl'}",
            f"reward.funcs=[{TASKS / 'multiply_reward.py'}:correct]",
            f"tools.funcs=[{tools}]", "grpo.max_completion_length=12",
            "model.max_positions=48", "run.save_every=0", "run.resume=none"]


def train(work: Path, steps: int, warm_steps: int) -> tuple[dict[str, Any], Path]:
    """The tool task from its warm start, trained for `steps` steps: its metrics.json and
    its trained model."""
    out = work / "train"
    start = warm(work / "data", work / "start", warm_steps)
    command = [sys.executable, "-m", "examples.rl_loop", f"model.path={start}",
               *task_overrides(work / "data", f"{TASKS / 'multiply_tools.py'}:calculator"),
               f"run.steps={steps}", f"run.eval_every={max(1, steps // 6)}", f"run.out={out}"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr[-2000:]}")
    return json.loads((out / "metrics.json").read_text()), out / "model"


async def throughput(work: Path, model: Path, episodes: int) -> dict[str, Any]:
    """`episodes` episodes of the trained model with 50 ms tools: all at once, then one at
    a time (see module)."""
    from colocate import phase
    from examples.rl_loop.config import load_config
    from examples.rl_loop.loop import Loop

    slow = work / "slow_tools.py"
    slow.write_text(SLOW_TOOL)
    cfg = load_config(overrides=[*task_overrides(work / "data", f"{slow}:calculator"),
                                 f"model.path={model}", "tools.workers=8", "run.slots=2",
                                 "generator.session_cache_mb=2",
                                 f"run.out={work / 'throughput'}"])
    loop = Loop(cfg)
    rollouts, busy = loop.rollouts, [0.0]
    generate = rollouts.generate_turns

    async def timed(*args: Any) -> list:
        began = time.monotonic()
        try:
            return await generate(*args)
        finally:
            busy[0] += time.monotonic() - began

    rollouts.generate_turns = timed  # this bench's own rollouts, timed
    rows = loop.source.eval_rows()[:episodes]
    found: dict[str, Any] = {}
    await loop.start()
    try:
        async with phase(loop.generator):
            await rollouts.episodes(rows[:2], loop.greedy, 1)  # warm
            for sticky in (True, False):
                rollouts.sticky = sticky
                got = await rollouts.episodes(rows, loop.greedy, 1)
                found["prefix_recompute_share_" + ("sticky" if sticky else "round_robin")] = \
                    got.metrics["prefix_recompute_share"]
            rollouts.sticky = True
            for arm in ("at_once", "one_at_a_time"):
                busy[0], began = 0.0, time.monotonic()
                if arm == "at_once":
                    got = [await rollouts.episodes(rows, loop.greedy, 1)]
                else:
                    got = [await rollouts.episodes([r], loop.greedy, 1) for r in rows]
                wall = time.monotonic() - began
                calls = sum(g.metrics["tools/calls"] for g in got)
                found[arm] = {"samples_per_s": len(rows) / wall, "wall_s": wall,
                              "generator_busy_share": busy[0] / wall, "tool_calls": calls}
                print(f"{arm}: {len(rows)} episodes in {wall:.2f} s, {calls} tool calls, "
                      f"generator busy {busy[0] / wall:.2f} of the time", flush=True)
    finally:
        await loop.stop()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="the tool task's GRPO steps")
    parser.add_argument("--warm-steps", type=int, default=300, help="the warm start's")
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    machine, command = announce()
    with tempfile.TemporaryDirectory(prefix="agentic_") as tmp:
        work = Path(tmp)
        multiply.write(work / "data")
        began = time.monotonic()
        metrics, model = train(work, args.steps, args.warm_steps)
        evals = [s for s in metrics["steps"] if "eval_reward" in s]
        print(f"tool task: eval {evals[0]['eval_reward']:.3f} -> {evals[-1]['eval_reward']:.3f}"
              f" in {args.steps} steps ({time.monotonic() - began:.0f} s)", flush=True)
        arms = asyncio.run(throughput(work, model, args.episodes))
    trained = [s for s in metrics["steps"] if "episode_tool_calls_mean" in s]
    result = {
        "machine": machine, "command": command, "steps": args.steps,
        "untrained_eval_reward": evals[0]["eval_reward"],
        "final_eval_reward": evals[-1]["eval_reward"],
        "tool_calls_per_episode": {"first_step": trained[0]["episode_tool_calls_mean"],
                                   "last_step": trained[-1]["episode_tool_calls_mean"]},
        "eval_curve": [(s["step"], s["eval_reward"]) for s in evals],
        "tool_ms": SLOW_MS, "episodes": args.episodes, **{
            f"{arm}_{k}": v for arm, found in arms.items() if isinstance(found, dict)
            for k, v in found.items()},
        "samples_per_s_ratio": arms["at_once"]["samples_per_s"]
        / arms["one_at_a_time"]["samples_per_s"],
        "generator_busy_share": {arm: arms[arm]["generator_busy_share"]
                                 for arm in ("at_once", "one_at_a_time")},
        **{k: v for k, v in arms.items() if k.startswith("prefix_")},
    }
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
