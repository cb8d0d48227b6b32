"""DAPO's dynamic sampling (`grpo.dynamic_sampling`): the groups whose rewards are all equal
are dropped and more prompts generated until the batch is full, in at most
`grpo.max_gen_batches` rounds.

The choice of groups is checked on the sync rollouts and the multi-turn ones with rewards
scripted per prompt (stand-in generate and score functions; the multi-turn episodes' turns
are scripted, their transcript and tokenizer real); then one short run of the loop on
Monarch procs, twice with one seed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from colocate.engines.sampling import Completion, SamplingParams
from colocate.engines.tiny import write_tiny_model
from examples.rl_loop.config import load_config
from examples.rl_loop.data import Row
from examples.rl_loop.episodes import AgentRollouts
from examples.rl_loop.grpo import GRPOConfig
from examples.rl_loop.loop import Loop
from examples.rl_loop.rollouts import ROUND_SEED, RolloutConfig, Rollouts
from examples.rl_loop.sources import Scored
from examples.rl_loop.tool_calls import plain_alphabet
from examples.rl_loop.tools import ToolsConfig, ToolStats, tool_schemas
from examples.rl_loop.transcripts import Transcript

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
CALCULATOR = f"{ROOT}/examples/rl_loop/tasks/multiply_tools.py:calculator"
EOS = "<eos>"


class Prompts:
    """A source of rows drawn in order from `prompts`; prompt k's tokens are [k]."""

    def __init__(self, prompts: list[str], tokens=None) -> None:
        self.prompts, self.drawn = prompts, 0
        self.tokens = tokens or (lambda text: [prompts.index(text)])

    def sample(self, n: int) -> list[Row]:
        texts = self.prompts[self.drawn:self.drawn + n]
        self.drawn += n
        return [Row(text, text, self.tokens(text), {}) for text in texts]


class Scripted:
    """The scoring stand-in: each prompt's rewards, its samples' in order (None: no reward,
    the sample dropped as reward.on_error=skip drops it)."""

    def __init__(self, rewards: dict[str, list[float | None]]) -> None:
        self.rewards, self.wheres = rewards, []

    async def __call__(self, where: str, rollout) -> Scored:
        self.wheres.append(where)
        size = len(rollout.completions) // len(rollout.rows)
        values = [self.rewards[row.prompt][i] for row in rollout.rows for i in range(size)]
        return Scored(values, [i for i, v in enumerate(values) if v is None],
                      {"rewards/f/mean": 0.5, "rewards/f/std": 0.0,
                       "samples_dropped": values.count(None)})


def sync_rollouts(prompts: list[str], rewards, seeds: list[int], **grpo) -> Rollouts:
    """`Rollouts` of group_size 3 whose generate call writes, for sample j of prompt k,
    the tokens [k, j] with log-probs [-k, -j] (and records each call's seed)."""

    async def generate(tokens: list[list[int]], params: SamplingParams) -> list[Completion]:
        seeds.append(params.seed)
        return [Completion([t[0], i % 3], [-float(t[0]), -float(i % 3)], stopped=True)
                for i, t in enumerate(tokens)]

    cfg = GRPOConfig(group_size=3, dynamic_sampling=True, **grpo)
    return Rollouts(Prompts(prompts), generate, lambda index: SamplingParams(seed=index),
                    cfg, 64, Scripted(rewards))


async def test_the_groups_without_a_signal_are_replaced_by_the_next_rounds():
    rewards = {"a": [1, 0, 1], "b": [1, 1, 1], "c": [0, 0, None], "d": [0, 1, 0],
               "e": [0.5, None, 0.5], "f": [1, 0, None], "g": [0, 0, 1], "h": [1, 0, 0],
               "i": [1, 0, 0]}
    seeds: list[int] = []
    rollouts = sync_rollouts(list(rewards), rewards, seeds, prompts_per_step=4)
    got = await rollouts.generate(5)
    # round 1: a, d have a signal (b all 1, c all 0 but a None); round 2: e (one value),
    # then f, g, h: two of them fill the batch, h is trimmed; i is never drawn
    assert [row.prompt for row in got.rows] == ["a", "d", "f", "g"]
    assert rollouts.source.drawn == 8
    assert seeds == [5, 5 + ROUND_SEED]
    assert rollouts.score.wheres == ["step 5", "step 5, round 2"]
    assert got.tokens == [[k] for k in (0, 3, 5, 6) for _ in range(3)]
    assert [c.tokens for c in got.completions] == [[k, j] for k in (0, 3, 5, 6)
                                                   for j in range(3)]
    assert [c.logprobs[0] for c in got.completions] == [-k for k in (0, 3, 5, 6)
                                                        for _ in range(3)]
    assert got.scored.values == [1, 0, 1, 0, 1, 0, 1, 0, None, 0, 0, 1]
    assert got.scored.dropped == [8]  # f's third sample, its place in the batch
    m = got.metrics
    assert (m["dynamic/gen_batches"], m["dynamic/groups_kept"], m["dynamic/groups_dropped"],
            m["dynamic/groups_trimmed"]) == (2, 4, 3, 1)
    assert m["finished_samples"] == 24  # every sample generated, both rounds'
    every = [v for k in "abcdefgh" for v in rewards[k] if v is not None]
    assert m["dynamic/reward_all_samples"] == pytest.approx(sum(every) / len(every))
    # the reward functions' figures pooled over both rounds' 24 samples
    assert got.scored.metrics == {"rewards/f/mean": 0.5, "rewards/f/std": 0.0,
                                  "samples_dropped": 3}


async def test_out_of_rounds_the_step_trains_on_what_it_found():
    rewards = {"a": [0, 0, 0], "b": [1, 0, 1], "c": [1, 1, 1], "d": [0, 0, 0]}
    rollouts = sync_rollouts(list(rewards), rewards, [], prompts_per_step=2,
                             max_gen_batches=2)
    got = await rollouts.generate(0)
    assert [row.prompt for row in got.rows] == ["b"]
    assert got.scored.values == [1, 0, 1]
    m = got.metrics
    assert (m["dynamic/gen_batches"], m["dynamic/groups_kept"], m["dynamic/groups_dropped"],
            m["dynamic/groups_trimmed"]) == (2, 1, 3, 0)


async def test_without_any_signal_the_last_rounds_groups_are_kept_as_they_are():
    rewards = {"a": [0, 0, 0], "b": [1, 1, 1], "c": [1, 1, 1], "d": [0, 0, None]}
    rollouts = sync_rollouts(list(rewards), rewards, [], prompts_per_step=2,
                             max_gen_batches=2)
    got = await rollouts.generate(0)
    assert [row.prompt for row in got.rows] == ["c", "d"]
    assert got.scored.dropped == [5]
    assert (got.metrics["dynamic/groups_kept"], got.metrics["dynamic/groups_dropped"]) == (0, 4)


async def test_without_dynamic_sampling_a_step_is_one_unscored_round():
    rewards = {"a": [1, 1, 1], "b": [0, 0, 0]}
    seeds: list[int] = []
    rollouts = sync_rollouts(list(rewards), rewards, seeds, prompts_per_step=2)
    rollouts.grpo = GRPOConfig(group_size=3, prompts_per_step=2)
    got = await rollouts.generate(3)
    assert [row.prompt for row in got.rows] == ["a", "b"] and got.scored is None
    assert seeds == [3] and rollouts.score.wheres == []
    assert not any(key.startswith("dynamic/") for key in got.metrics)


class Script:
    """A stand-in policy: each prompt's turns, written in order, whatever the sample."""

    def __init__(self, tokenizer, turns: dict[str, list[str]]) -> None:
        self.tokenizer, self.turns = tokenizer, turns

    async def generate(self, prompts, params, sessions=None, sticky=None,
                       continuous=False) -> list[Completion]:
        out = []
        for prompt in prompts:
            text = self.tokenizer.decode(prompt, skip_special_tokens=False)
            [row] = [r for r in self.turns if r in text]
            said = self.turns[row].pop(0)
            tokens = self.tokenizer(said.removesuffix(EOS), add_special_tokens=False).input_ids
            tokens += [self.tokenizer.eos_token_id] if said.endswith(EOS) else []
            out.append(Completion(tokens, [-0.25] * len(tokens),
                                  stopped=tokens[-1] in params.stop_token_ids))
        return out


class NoCalls:
    """The tools' client of episodes that never make a call that parses: only its stats
    are asked for."""

    def take_stats(self) -> ToolStats:
        return ToolStats()


async def test_multi_turn_episodes_keep_their_masks_rewards_and_figures(tmp_path):
    path = write_tiny_model(tmp_path / "m", "qwen2", max_positions=64,
                            alphabet="0123456789*=" + plain_alphabet(["calculator"]))
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = ["1*1=", "2*2=", "3*3=", "4*4="]
    # u(...) names no tool: a bad call, answered [!], then a second turn
    script = Script(tokenizer, {"1*1=": ["u(1)", "1" + EOS, "1" + EOS],
                                "2*2=": ["4" + EOS, "4" + EOS],
                                "3*3=": ["9" + EOS, "u(3)", "9" + EOS],
                                "4*4=": ["16" + EOS, "16" + EOS]})
    score = Scripted({"1*1=": [0, 1], "2*2=": [1, 1], "3*3=": [1, 0], "4*4=": [0.5, 0.2]})
    grpo = GRPOConfig(group_size=2, prompts_per_step=2, dynamic_sampling=True)
    rollouts = AgentRollouts(
        Prompts(prompts, lambda text: tokenizer(text).input_ids), script.generate,
        lambda index: SamplingParams(max_new_tokens=10, seed=index,
                                     stop_token_ids=(tokenizer.eos_token_id,)),
        grpo, 8, RolloutConfig(max_turns=3, bad_call_reward=-0.5),
        Transcript(tokenizer, tool_schemas(ToolsConfig(funcs=[CALCULATOR]))), NoCalls, 64,
        script.generate, score)
    got = await rollouts.generate(0)
    assert [row.prompt for row in got.rows] == ["1*1=", "3*3="]  # 2*2= dropped, 4*4= trimmed
    texts = [tokenizer.decode(c.tokens, skip_special_tokens=True) for c in got.completions]
    assert texts == ["u(1)[!]1", "1", "9", "u(3)[!]9"]
    untrained = ["".join(tokenizer.decode([t]) for t, mine in zip(c.tokens, trained,
                                                                  strict=True) if not mine)
                 for c, trained in zip(got.completions, got.trained, strict=True)]
    assert untrained == ["[!]", "", "", "[!]"]
    assert all(lp == (-0.25 if mine else 0.0) for c, tr in
               zip(got.completions, got.trained, strict=True)
               for lp, mine in zip(c.logprobs, tr, strict=True))
    assert got.extra_rewards == [-0.5, 0.0, 0.0, -0.5]
    assert [e.row.prompt for e in got.episodes] == ["1*1=", "1*1=", "3*3=", "3*3="]
    m = got.metrics
    assert m["episode_turns_mean"] == 6 / 4 and m["episode_bad_calls"] == 2  # the kept ones
    assert m["finished_samples"] == 8 and m["tools/calls"] == 0
    assert (m["dynamic/gen_batches"], m["dynamic/groups_kept"], m["dynamic/groups_dropped"],
            m["dynamic/groups_trimmed"]) == (2, 2, 1, 1)


def test_config_refuses_bad_dynamic_sampling_settings():
    assert load_config().grpo.dynamic_sampling is False
    with pytest.raises(ValueError, match=r"^GRPOConfig.max_gen_batches=0: must be >= 1$"):
        load_config(overrides=["grpo.max_gen_batches=0"])
    with pytest.raises(ValueError, match="dynamic_sampling=true with rollout.mode=partial"):
        load_config(overrides=["grpo.dynamic_sampling=true", "rollout.mode=partial"])
    with pytest.raises(ValueError, match="grpo.dynamic_sampling: Value 'maybe'"):
        load_config(overrides=["grpo.dynamic_sampling=maybe"])


async def test_the_loop_fills_its_batches_and_repeats(tmp_path):
    """A short run: each step's row counts the rounds and groups; two runs with one seed
    give the same metrics."""
    runs = []
    for name in ("a", "b"):
        cfg = load_config(overrides=[
            "run.steps=3", "run.eval_every=3", "run.save_every=0", "grpo.prompts_per_step=8",
            "grpo.group_size=2", "grpo.dynamic_sampling=true", "grpo.max_gen_batches=3",
            f"run.out={tmp_path / name}"])
        await Loop(cfg).run()
        runs.append([s for s in json.loads((tmp_path / name / "metrics.json").read_text())
                     ["steps"] if s["step"] >= 0])
    steps = runs[0]
    assert len(steps) == 3
    for s in steps:
        rounds, kept = s["dynamic/gen_batches"], s["dynamic/groups_kept"]
        assert 1 <= rounds <= 3 and kept <= 8
        assert kept + s["dynamic/groups_dropped"] + s["dynamic/groups_trimmed"] == 8 * rounds
        assert s["finished_samples"] == 16 * rounds
        if rounds < 3:  # the rounds sufficed
            assert kept == 8
    assert any(s["dynamic/gen_batches"] > 1 for s in steps)  # a refill was needed

    def figures(step):
        return {k: v for k, v in step.items() if k.startswith("dynamic/") or k in (
            "reward", "loss", "finished_samples", "completion_len_mean", "eval_reward")}
    assert [figures(s) for s in runs[0]] == [figures(s) for s in runs[1]]
