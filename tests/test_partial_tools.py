"""Multi-turn episodes with tools in partial rollouts (issue 47, item 5): an episode is an
item of the partial pool, so it may span steps; a turn cut by the token budget goes on
from where it stopped, a tool call under way at a step's end survives the switch (and is
made again after a resume), the loss never covers an observation token, and a run with
tools repeats, resumes and restarts after a killed proc as the run never stopped.

The pool's test scripts the model's turns (every path taken for sure, on a real tokenizer
and the task's real calculator); the loop's run the README's tool task from its warm start
with a token budget that cuts its calls in two."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_partial_loop import KillingHooks

from colocate.engines.sampling import Completion, SamplingParams
from colocate.engines.tiny import write_tiny_model
from colocate.engines.tools import ToolResult
from examples.rl_loop.config import as_dict, load_config
from examples.rl_loop.data import Row
from examples.rl_loop.episodes import AgentRollouts
from examples.rl_loop.grpo import GRPOConfig
from examples.rl_loop.loop import Loop
from examples.rl_loop.partial_episodes import EpisodePool
from examples.rl_loop.rollouts import RolloutConfig
from examples.rl_loop.state import LoopState, identity
from examples.rl_loop.tasks import multiply
from examples.rl_loop.tasks.multiply_tools import calculator
from examples.rl_loop.tasks.multiply_warm import task_overrides, warm
from examples.rl_loop.tool_calls import plain_alphabet
from examples.rl_loop.transcripts import Transcript

pytestmark = pytest.mark.timeout(900)
EOS = 2

# a call (`c(123*456)`, 10 tokens) takes two steps' budgets: it closes as the second ends
PARTIAL = ["rollout.mode=partial", "rollout.max_tokens_per_step=5", "grpo.prompts_per_step=4",
           "run.eval_every=3"]
KEYS = ("reward", "loss", "eval_reward", "finished_samples", "carried_samples",
        "carried_tokens", "staleness_hist", "is_weight", "episode_ended",
        "episode_tool_calls_mean", "episode_trained_tokens_mean", "tools/calls",
        "partial/episodes_carried", "partial/calls_carried", "prefetched_tokens")


class Calculator:
    """A stand-in for the tools' client: the task's calculator, called here, counted."""

    def __init__(self) -> None:
        self.made: list[str] = []

    async def call(self, name: str, arguments: dict) -> ToolResult:
        self.made.append(arguments["expression"])
        return ToolResult(calculator(**arguments))


class Policy:
    """A stand-in model that writes each row's whole transcript (its observations as the
    tool will answer): each call continues a row from its tokens so far, to its next stop
    or call-closing token or the call's max_new_tokens."""

    def __init__(self, transcripts: dict[tuple[int, ...], list[int]]) -> None:
        self.transcripts = transcripts

    async def generate(self, prompts: list[list[int]], params: SamplingParams,
                       sessions: list[str], sticky: bool, continuous: bool = False
                       ) -> list[Completion]:
        out = []
        for prompt in prompts:
            [whole] = [t for t in self.transcripts.values() if t[:len(prompt)] == prompt]
            tokens = []
            for token in whole[len(prompt):len(prompt) + params.max_new_tokens]:
                tokens.append(token)
                if token in params.stop_token_ids:
                    break
            out.append(Completion(tokens, [-0.5] * len(tokens),
                                  stopped=tokens[-1] in params.stop_token_ids))
        return out


def pool_of(tokenizer, client: Calculator, budget: int) -> EpisodePool:
    cfg = RolloutConfig(mode="partial", max_tokens_per_step=budget, max_turns=3)
    agent = AgentRollouts(None, None, None, GRPOConfig(group_size=2), 8, cfg,
                          Transcript(tokenizer, [calculator_schema()]), lambda: client, 64,
                          None)
    return EpisodePool(cfg, 2, 12, 8, agent)


def calculator_schema() -> dict:
    from transformers.utils import get_json_schema
    return get_json_schema(calculator)


async def test_an_episode_spans_rounds_its_call_under_way_survives_a_checkpoint(tmp_path):
    path = write_tiny_model(tmp_path / "m", "qwen2", max_positions=64,
                            alphabet="0123456789*=" + plain_alphabet(["calculator"]))
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    rows = [Row(p, p, tokenizer(p).input_ids, {}) for p in ("12*34=", "7*6=")]
    policy = Policy({tuple(rows[0].tokens): rows[0].tokens + ids("c(12*34)[408]408") + [EOS],
                     tuple(rows[1].tokens): rows[1].tokens + ids("42") + [EOS]})
    params = SamplingParams(max_new_tokens=12, stop_token_ids=(EOS,), seed=1)
    client = Calculator()
    pool = pool_of(tokenizer, client, budget=4)
    pool.add(rows, 0)
    # round 1: the call's first 4 tokens; the answer "42" and its stop, whole
    assert await pool.advance(policy.generate, params) == {"tokens": 4 * 2 + 3 * 2,
                                                          "slots": 4 * 4, "calls": 1}
    first, answered = pool.groups
    assert answered.done and not first.done
    assert [t.turn() for t in first.samples] == [ids("c(12")] * 2  # a turn in progress
    pool.version += 1  # a sync: the next round samples on newer weights
    # round 2: the call closes as the budget runs out: under way, across the next switch
    await pool.advance(policy.generate, params)
    assert all(t.pending == "c(12*34)" for t in first.samples)
    assert len(pool.under_way) == 2 and all(t.turns == 1 for t in first.samples)
    saved = json.loads(json.dumps(pool.state_dict()))  # what loop.json keeps
    pool.version += 1
    await pool.advance(policy.generate, params)  # its results read, then the answer
    restored_client = Calculator()
    restored = pool_of(tokenizer, restored_client, budget=4)
    restored.load_state_dict(saved)
    restored.version += 1
    await restored.advance(policy.generate, params)  # the call made again, as it was
    assert client.made == restored_client.made == ["12*34", "12*34"]
    for ran, again in zip(first.samples, restored.groups[0].samples, strict=True):
        assert ran == again and ran.completion().versions == again.completion().versions
        assert ran.ended == "answer" and (ran.turns, ran.calls) == (2, 1)
        assert ran.tokens == ids("c(12*34)[408]408") + [EOS]
        # the observation's tokens alone are masked, whichever round added them
        assert ran.trained == [True] * 8 + [False] * 5 + [True] * 4
        assert ran.versions == [0] * 4 + [1] * 4 + [2] * 9
        assert [m["role"] for m in ran.messages] == ["assistant", "tool", "assistant"]
    figures = pool.take_figures()
    assert figures["tools/calls"] == 2 and figures["tools/errors"] == 0
    # past max_staleness (`rollout.on_stale=finish`): a round takes episodes to their ends
    finishing = pool_of(tokenizer, Calculator(), budget=4)
    finishing.add(rows[:1], 0)
    await finishing.advance(policy.generate, params, finish=True)
    assert [t.tokens for t in finishing.groups[0].samples] == [first.samples[0].tokens] * 2


def test_tools_and_an_environment_take_partial_rollouts(tmp_path):
    """A partial run with tools, or an environment too, is a run of its own (its
    checkpoints resume only as such: test_partial_envs)."""
    cfg = load_config(overrides=[*task_overrides(tmp_path), *PARTIAL])
    assert cfg.rollout.partial and cfg.tools.used
    assert identity(as_dict(cfg))["rollout"]["mode"] == "partial"
    cfg = load_config(overrides=[*task_overrides(tmp_path), *PARTIAL, "env.cls=m:C"])
    assert identity(as_dict(cfg))["env.cls"] == "m:C"


@pytest.fixture(scope="module")
def tool_task(tmp_path_factory):
    """The tool task's data and a short warm start (it calls now and then when sampled)."""
    root = tmp_path_factory.mktemp("tool_task")
    multiply.write(root / "data", eval_size=16)
    return root / "data", warm(root / "data", root / "start", steps=60)


async def run(tool_task, out: Path, *overrides: str, hooks=None) -> list[dict]:
    data, start = tool_task
    cfg = load_config(overrides=[*task_overrides(data), f"model.path={start}", *PARTIAL,
                                 f"run.out={out}", *overrides])
    await Loop(cfg, hooks=hooks).run()
    return json.loads((out / "metrics.json").read_text())


def figures(steps: list[dict]) -> list[tuple]:
    return [(s["step"], *(s.get(k) for k in KEYS)) for s in steps]


def in_flight(out: Path, step: int) -> tuple[int, int]:
    """The episodes under way in step `step`'s checkpoint, and the calls among them."""
    saved = LoopState.read(out / "checkpoints" / f"step_{step:08d}" / "loop.json")
    going = [s for g in saved.carried["groups"] for s in g["samples"] if not s["ended"]]
    return len(going), sum(s["pending"] is not None for s in going)


async def test_partial_episodes_span_steps_and_a_resumed_run_is_the_run_never_stopped(
        tool_task, tmp_path):
    whole = (await run(tool_task, tmp_path / "whole", "run.steps=6", "run.save_every=0"))
    rows = whole["steps"][1:]
    assert sum(r["partial/episodes_carried"] for r in rows) > 0  # trained across steps
    assert sum(r["partial/calls_carried"] for r in rows) > 0  # calls under way at a switch
    assert sum(r["tools/calls"] for r in rows) > 0
    assert max(int(k) for r in rows for k in r["staleness_hist"]) >= 1
    # the same seed, stopped after 3 steps (episodes and a call under way in its
    # checkpoint), then resumed: the run never stopped
    out = tmp_path / "stopped"
    await run(tool_task, out, "run.steps=3", "run.save_every=3")
    going, calls = in_flight(out, 3)
    assert going > 0 and calls > 0
    resumed = await run(tool_task, out, "run.steps=6", "run.save_every=3",
                        "run.resume=auto")
    assert figures(resumed["steps"]) == figures(whole["steps"])


async def test_with_overlap_a_killed_proc_restarts_into_the_run_never_killed(
        tool_task, tmp_path):
    """rollout.overlap: each step's next round (episodes and their tool calls) runs beside
    its training; the slot proc killed as step 3 generates: the loop goes back to step
    2's checkpoint (episodes under way in it) and ends as the run never killed."""
    overlap = ("rollout.overlap=true", "run.steps=4", "run.save_every=2")
    whole = await run(tool_task, tmp_path / "whole", *overlap)
    rows = whole["steps"][1:]
    assert all(r["prefetched_tokens"] > 0 for r in rows)
    assert sum(r["partial/episodes_carried"] for r in rows) > 0
    assert in_flight(tmp_path / "whole", 2)[0] > 0
    hooks = KillingHooks()
    killed = await run(tool_task, tmp_path / "killed", *overlap, hooks=hooks)
    assert hooks.killed and [r["resumed_at"] for r in killed["restarts"]] == [2]
    assert figures(killed["steps"]) == figures(whole["steps"])
