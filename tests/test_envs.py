"""Multi-turn episodes against a stateful environment (`env.cls`): each episode's own
instance opens it (`reset`'s messages are the prompt), sees each of the model's turns
(`step`) and answers with observations (appended, never trained on) until `done` or
`rollout.max_turns`, with tools' calls run first where there are tools too; an
environment that raises or hangs in `step` ends only its episode, counted; one that cannot
open an episode, or answers in the wrong shape, is an error that names the class and what
was expected.

The model's turns are scripted (`test_episodes.Script`); the environments, tokenizers,
templates and the loss mask are real. The last test runs the example game
(`tasks/guess.py`) through the whole loop."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path

import pytest
from test_episodes import EOS, SPECIAL, TEMPLATE, Script, row

from colocate.engines.sampling import SamplingParams
from colocate.engines.tiny import write_tiny_model
from colocate.testing import start_runtime
from examples.rl_loop.config import as_dict, load_config
from examples.rl_loop.envs import EnvConfig, EnvError, Environments
from examples.rl_loop.episodes import AgentRollouts
from examples.rl_loop.grpo import GRPOConfig
from examples.rl_loop.loop import Loop
from examples.rl_loop.rollouts import RolloutConfig
from examples.rl_loop.sources import Scored
from examples.rl_loop.state import identity
from examples.rl_loop.tasks import guess
from examples.rl_loop.tool_calls import plain_alphabet
from examples.rl_loop.tools import ToolClient, ToolsConfig, tool_schemas
from examples.rl_loop.transcripts import ChatTranscript, Transcript

pytestmark = pytest.mark.timeout(300)
TASKS = Path(__file__).resolve().parents[1] / "examples" / "rl_loop" / "tasks"
CALCULATOR = f"{TASKS / 'multiply_tools.py'}:calculator"

ENVS = '''
import asyncio
import time


class Hint:
    """Says no until the model writes the row's target; keeps what it saw."""

    seen = []

    def reset(self, row):
        self.target = row["target"]
        return [{"role": "system", "content": row["prompt"]}, {"role": "user", "content": "?"}]

    def step(self, message):
        Hint.seen.append((self.target, message))
        if message["content"] == self.target:
            return [], True
        return [{"role": "user", "content": "no"}], False


class Faulty(Hint):
    def step(self, message):
        if self.target == "13":
            raise RuntimeError("the board broke")
        if self.target == "14":
            time.sleep(10)  # a plain method that hangs: on its thread, past the bound
        return super().step(message)


class AsyncHang(Hint):
    async def step(self, message):
        await asyncio.sleep(30)


class BadShape(Hint):
    def step(self, message):
        return [{"role": "user", "content": "no"}]


class BadReset(Hint):
    def reset(self, row):
        raise KeyError("level")


class Fails:
    def __init__(self):
        raise RuntimeError("no display")

    def reset(self, row):
        return []

    def step(self, message):
        return [], True
'''


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    """`spec("Hint")`: the env.cls of a class of ENVS, written to a file."""
    path = tmp_path_factory.mktemp("envs") / "my_envs.py"
    path.write_text(ENVS)
    return lambda name: f"{path}:{name}"


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    alphabet = "".join(sorted(set("0123456789*+=?no" + plain_alphabet(["calculator"]))))
    path = write_tiny_model(tmp_path_factory.mktemp("plain") / "m", "qwen2",
                            alphabet=alphabet, max_positions=64)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def game(tokenizer, prompt: str, target: str):
    """A data row whose environment wants `target`."""
    return replace(row(tokenizer, prompt), columns={"target": target})


def rollouts(script: Script, transcript: Transcript, envs: Environments, positions: int = 64,
             tools: ToolClient | None = None, **rollout) -> AgentRollouts:
    """Episodes with an environment (and no tools, unless given), turns from `script`."""
    grpo = GRPOConfig(group_size=2, prompts_per_step=1)  # unused: episodes() is given its rows
    return AgentRollouts(None, script.generate, lambda i: None, grpo, 8,
                         RolloutConfig(**rollout), transcript, lambda: tools, positions,
                         lambda tokens, params, *routing: script.generate(tokens, params),
                         envs=envs)


def params(tokenizer) -> SamplingParams:
    return SamplingParams(max_new_tokens=6, stop_token_ids=(tokenizer.eos_token_id,))


def observed(tokenizer, rollout) -> list[str]:
    """Each sample's tokens the loss leaves out, as text."""
    return ["".join(tokenizer.decode([t]) for t, mine in zip(c.tokens, trained, strict=True)
                    if not mine)
            for c, trained in zip(rollout.completions, rollout.trained, strict=True)]


async def test_an_episode_opens_steps_and_ends_by_its_environment(plain, spec):
    tokenizer = plain
    envs = Environments(EnvConfig(cls=spec("Hint")))
    envs.cls.seen.clear()
    transcript = Transcript(tokenizer, [])
    assert transcript.stop_ids == ()  # no tools: a turn ends at the stop token alone
    rows = [game(tokenizer, "6*7=", "42"), game(tokenizer, "1+2=", "3")]
    script = Script(tokenizer, {"6*7=": ["41" + EOS, "42" + EOS],
                                "1+2=": ["1" + EOS, "2" + EOS, "4" + EOS]}, ())
    got = await rollouts(script, transcript, envs, max_turns=3).episodes(
        rows, params(tokenizer), 1)
    # reset's messages are the prompt: the plain form reads their contents in order
    assert got.tokens == [tokenizer("6*7=?").input_ids, tokenizer("1+2=?").input_ids]
    assert [r.prompt for r in got.rows] == ["6*7=?", "1+2=?"]
    assert got.rows[0].columns == {"target": "42"}  # the reward functions' columns
    # each turn reached step as the assistant's message, its stop token left out
    assert [m for t, m in envs.cls.seen if t == "42"] == [
        {"role": "assistant", "content": "41"}, {"role": "assistant", "content": "42"}]
    assert [m["content"] for t, m in envs.cls.seen if t == "3"] == ["1", "2", "4"]
    texts = [tokenizer.decode(c.tokens, skip_special_tokens=True) for c in got.completions]
    assert texts == ["41no42", "1no2no4no"]  # max_turns bounds it; the last step's kept
    assert observed(tokenizer, got) == ["no", "nonono"]  # never trained on
    assert all(lp == 0.0 for c, tr in zip(got.completions, got.trained, strict=True)
               for lp, mine in zip(c.logprobs, tr, strict=True) if not mine)
    assert [c.stopped for c in got.completions] == [True, False]
    assert script.calls == 3
    m = got.metrics
    assert m["episode_ended"] == {"done": 1, "max_turns": 1}
    assert (m["env/steps"], m["env/errors"], m["env/done_share"]) == (5, 0, 0.5)
    assert "tools/calls" not in m


async def test_tool_calls_run_first_and_the_environment_steps_on_the_answer(plain, spec):
    tokenizer = plain
    envs = Environments(EnvConfig(cls=spec("Hint")))
    envs.cls.seen.clear()
    cfg = ToolsConfig(funcs=[CALCULATOR])
    transcript = Transcript(tokenizer, tool_schemas(cfg))
    script = Script(tokenizer, {"6*7=": ["c(6*7)", "42" + EOS]}, transcript.stop_ids)
    async with start_runtime(gpus_per_host=1):
        client = await ToolClient.spawn(cfg)
        got = await rollouts(script, transcript, envs, tools=client, max_turns=3).episodes(
            [game(tokenizer, "6*7=", "42")], params(tokenizer), 1)
    assert tokenizer.decode(got.completions[0].tokens, skip_special_tokens=True) == \
        "c(6*7)[42]42"
    assert [m for _, m in envs.cls.seen] == [{"role": "assistant", "content": "42"}]
    m = got.metrics
    assert (m["tools/calls"], m["env/steps"], m["episode_ended"]) == (1, 1, {"done": 1})


async def test_dynamic_sampling_counts_every_rounds_environment_steps(plain, spec):
    """With `grpo.dynamic_sampling`, a group without a learning signal is dropped: the
    batch is the kept group's episodes, the `env/*` figures every round's (the work done)."""
    tokenizer = plain
    games = iter([game(tokenizer, "6*7=", "42"), game(tokenizer, "1+2=", "3")])
    source = type("Source", (), {"sample": lambda self, n: [next(games) for _ in range(n)]})
    script = Script(tokenizer, {"6*7=": ["42" + EOS, "42" + EOS],
                                "1+2=": ["3" + EOS, "1" + EOS, "3" + EOS]}, ())
    rewards = {"6*7=?": [1.0, 1.0], "1+2=?": [0.0, 1.0]}  # by the opening, the rows' prompt

    async def score(where, rollout) -> Scored:
        return Scored(list(rewards[rollout.rows[0].prompt]))

    rollouts = AgentRollouts(
        source(), script.generate,
        lambda index: SamplingParams(max_new_tokens=6, seed=index,
                                     stop_token_ids=(tokenizer.eos_token_id,)),
        GRPOConfig(group_size=2, prompts_per_step=1, dynamic_sampling=True, max_gen_batches=2),
        8, RolloutConfig(max_turns=3), Transcript(tokenizer, []), lambda: None, 64,
        lambda tokens, params, sessions, sticky, continuous: script.generate(tokens, params), score,
        Environments(EnvConfig(cls=spec("Hint"))))
    got = await rollouts.generate(0)
    assert [r.prompt for r in got.rows] == ["1+2=?"] and got.scored.values == [0.0, 1.0]
    texts = [tokenizer.decode(c.tokens, skip_special_tokens=True) for c in got.completions]
    assert texts == ["3", "1no3"]
    m = got.metrics
    assert (m["env/steps"], m["env/errors"], m["env/done_share"]) == (5, 0, 1.0)
    assert m["episode_turns_mean"] == 3 / 2 and m["dynamic/groups_dropped"] == 1
    assert "tools/calls" not in m and "tools/seconds" not in m


async def test_a_failing_or_hanging_step_ends_only_its_episode(plain, spec, caplog):
    tokenizer = plain
    envs = Environments(EnvConfig(cls=spec("Faulty"), timeout_s=0.5))
    rows = [game(tokenizer, "6*7=", "42"), game(tokenizer, "9+4=", "13"),
            game(tokenizer, "7+7=", "14")]
    script = Script(tokenizer, {"6*7=": ["40" + EOS, "42" + EOS], "9+4=": ["1" + EOS],
                                "7+7=": ["2" + EOS]}, ())
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="examples.rl_loop.envs"):
        got = await rollouts(script, Transcript(tokenizer, []), envs, max_turns=3).episodes(
            rows, params(tokenizer), 1)
    assert time.monotonic() - began < 5  # the hung step was given up at env.timeout_s
    m = got.metrics
    assert m["episode_ended"] == {"done": 1, "env_error": 2}
    assert (m["env/errors"], m["env/errors/raised"], m["env/errors/timeout"]) == (2, 1, 1)
    assert m["env/steps"] == 4 and m["env/done_share"] == 1 / 3
    texts = [tokenizer.decode(c.tokens, skip_special_tokens=True) for c in got.completions]
    assert texts == ["40no42", "1", "2"]
    logged = caplog.text
    assert "env Faulty.step on row" in logged and "'target': '13'" in logged
    assert "raised RuntimeError: the board broke" in logged
    assert "'target': '14'" in logged and "ran past env.timeout_s=0.5" in logged

    hangs = Environments(EnvConfig(cls=spec("AsyncHang"), timeout_s=0.2))
    got = await rollouts(Script(tokenizer, {"6*7=": ["1" + EOS]}, ()), Transcript(tokenizer, []),
                         hangs).episodes([rows[0]], params(tokenizer), 1)
    assert got.metrics["env/errors/timeout"] == 1


async def test_an_environment_that_cannot_open_or_answers_wrong_is_an_error(plain, spec):
    tokenizer = plain
    rows = [game(tokenizer, "6*7=", "42")]
    script = Script(tokenizer, {"6*7=": ["1" + EOS]}, ())
    with pytest.raises(EnvError, match=r"BadShape.step returned \[.*\]: expected a tuple "
                                       r"\(messages, done\)"):
        await rollouts(script, Transcript(tokenizer, []),
                       Environments(EnvConfig(cls=spec("BadShape")))).episodes(
            rows, params(tokenizer), 1)
    with pytest.raises(EnvError, match=r"env.cls: BadReset\(\) or reset on row .*'target': "
                                       r"'42'.* raised KeyError: 'level'"):
        await rollouts(script, Transcript(tokenizer, []),
                       Environments(EnvConfig(cls=spec("BadReset")))).episodes(
            rows, params(tokenizer), 1)
    with pytest.raises(EnvError, match=r"Hint.reset on row .*: its opening is \d+ tokens, "
                                       "the model has 4 positions"):
        await rollouts(script, Transcript(tokenizer, []),
                       Environments(EnvConfig(cls=spec("Hint"))), positions=4).episodes(
            rows, params(tokenizer), 1)


def test_a_bad_environment_is_refused_in_one_line_before_the_run(spec, tmp_path):
    for name, match in [("Fails", r"Fails\(\) raised RuntimeError: no display"),
                        ("Nope", "has no 'Nope'")]:
        with pytest.raises(EnvError, match=f"env.cls: .*{match}") as err:
            Environments(EnvConfig(cls=spec(name)))
        assert "\n" not in str(err.value)
    task = ["data.train_files=t.jsonl", "data.eval_files=e.jsonl", "reward.funcs=[m:f]",
            "grpo.max_completion_length=8"]
    for more, match in [([], "env.cls needs data.train_files"),
                        ([*task, "env.timeout_s=0"], "env.timeout_s=0.0: must be a number > 0"),
                        (["env.cls=nocolon"], "env.cls: 'nocolon': write module:Class")]:
        with pytest.raises(ValueError, match=match):
            load_config(overrides=[f"env.cls={spec('Hint')}", *more])
    cfg = load_config(overrides=[*task, f"env.cls={spec('Hint')}"])
    assert cfg.env.timeout_s == 10.0
    assert identity(as_dict(cfg))["env.cls"] == spec("Hint")  # another env: another run
    guess.write(tmp_path / "data", train_size=8, eval_size=4)
    cfg = load_config(overrides=[*guess.overrides(tmp_path / "data"),
                                 f"env.cls={spec('Fails')}", f"run.out={tmp_path / 'run'}"])
    with pytest.raises(EnvError, match=r"Fails\(\) raised"):
        Loop(cfg)  # refused before any proc starts
    record = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert "Fails() raised" in record["summary"]["failed"]


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """A character model whose chat template renders roles between `<|im_start|>` and
    `<|im_end|>` (its end of turn), special tokens of their own."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    path = write_tiny_model(tmp_path_factory.mktemp("chat") / "m", "qwen2",
                            alphabet="0123456789*=?abcdefghijklmnopqrstuvwxyz",
                            max_positions=256)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": [
        AddedToken(t, special=True) for t in SPECIAL]})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


async def test_a_chat_episode_renders_the_opening_and_observations_by_the_template(chat,
                                                                                    spec):
    tokenizer = chat
    envs = Environments(EnvConfig(cls=spec("Hint")))
    envs.cls.seen.clear()
    script = Script(tokenizer, {"6*7=": ["41" + EOS, "42" + EOS]}, ())  # EOS: <|im_end|>
    got = await rollouts(script, ChatTranscript(tokenizer, [], "hermes"), envs, 256,
                         max_turns=3).episodes([game(tokenizer, "6*7=", "42")],
                                               params(tokenizer), 1)
    opening = [{"role": "system", "content": "6*7="}, {"role": "user", "content": "?"}]
    assert got.rows[0].prompt == opening and got.rows[0].chat
    assert got.rows[0].text == ("<|im_start|>system6*7=<|im_end|><|im_start|>user?<|im_end|>"
                                "<|im_start|>assistant")
    assert got.tokens[0] == tokenizer(got.rows[0].text, add_special_tokens=False).input_ids
    [completion], [trained] = got.completions, got.trained
    shown = "<|im_start|>userno<|im_end|><|im_start|>assistant"
    assert tokenizer.decode(completion.tokens, skip_special_tokens=False) == \
        "41<|im_end|>" + shown + "42<|im_end|>"
    assert tokenizer.decode([t for t, mine in zip(completion.tokens, trained, strict=True)
                             if not mine], skip_special_tokens=False) == shown
    assert [m["content"] for _, m in envs.cls.seen] == ["41", "42"]  # without <|im_end|>
    assert got.conversations == [[{"role": "assistant", "content": "41"},
                                   {"role": "user", "content": "no"},
                                   {"role": "assistant", "content": "42"}]]


async def test_the_guessing_game_runs_through_the_loop(tmp_path: Path):
    guess.write(tmp_path / "data", train_size=64, eval_size=8)
    cfg = load_config(overrides=[*guess.overrides(tmp_path / "data"), "run.steps=2",
                                 "run.eval_every=2", "run.save_every=0",
                                 "grpo.prompts_per_step=4", "grpo.max_completion_length=8",
                                 "model.max_positions=128",  # the random model: longer turns
                                 f"run.out={tmp_path / 'run'}"])
    summary = await Loop(cfg).run()
    assert 0 <= summary["final_eval_reward"] <= 1
    steps = [s for s in json.loads((tmp_path / "run" / "metrics.json").read_text())["steps"]
             if s["step"] >= 0]
    assert len(steps) == 2
    for step in steps:
        assert step["finished_samples"] == 4 * cfg.grpo.group_size
        assert {"env/steps", "env/errors", "env/done_share"} <= set(step)
        assert step["env/errors"] == 0
    assert sum(s["env/steps"] for s in steps) > 0
