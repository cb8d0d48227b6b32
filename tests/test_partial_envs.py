"""Episodes stepped by an environment (`env.cls`) in partial rollouts: an episode spans
rounds and checkpoints, its environment comes back after a resume (by replay of its steps,
or by its class's `state_dict` / `load_state_dict`), and it ends as the episode never
stopped; an environment that a replay cannot bring back is an error that says what to
define. The loop's run: the guessing game (`tasks/guess.py`) stopped and resumed equals the
run never stopped.

The pool's tests script the model's turns (the `Policy` of test_partial_tools) on a real
tokenizer and the task's real environment."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_partial_tools import EOS, Policy

from colocate.engines.sampling import Completion, SamplingParams
from colocate.engines.tiny import write_tiny_model
from examples.rl_loop.config import load_config
from examples.rl_loop.data import Row
from examples.rl_loop.envs import EnvConfig, EnvError, Environments
from examples.rl_loop.episodes import AgentRollouts
from examples.rl_loop.grpo import GRPOConfig
from examples.rl_loop.loop import Loop
from examples.rl_loop.partial_episodes import EpisodePool
from examples.rl_loop.rollouts import RolloutConfig
from examples.rl_loop.state import LoopState
from examples.rl_loop.tasks import guess
from examples.rl_loop.transcripts import Transcript

pytestmark = pytest.mark.timeout(600)
GUESS = Path(guess.__file__).resolve()

DRAWN = '''
import random


class Drawn:
    """Answers every turn with a code it drew at reset: a replay draws another."""

    def reset(self, row):
        self.code = random.Random().randint(10 ** 8, 10 ** 9)
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, message):
        return [{"role": "user", "content": str(self.code)}], False


class Kept(Drawn):
    """The same, saying what it holds."""

    def state_dict(self):
        return {"code": self.code}

    def load_state_dict(self, state):
        self.code = state["code"]
'''


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("m") / "m", "qwen2", max_positions=96,
                            alphabet="".join(sorted(set(guess.PROMPT + "0123456789"))))
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    path = tmp_path_factory.mktemp("envs") / "drawn.py"
    path.write_text(DRAWN)
    return lambda name: f"{path}:{name}"


def pool_of(tokenizer, cls: str, budget: int = 2) -> EpisodePool:
    cfg = RolloutConfig(mode="partial", max_tokens_per_step=budget, max_turns=7)
    agent = AgentRollouts(None, None, None, GRPOConfig(group_size=2), 8, cfg,
                          Transcript(tokenizer, []), lambda: None, 96, None,
                          envs=Environments(EnvConfig(cls=cls)))
    return EpisodePool(cfg, 2, 3, 8, agent)


def game(tokenizer, secret: int, guesses: list[int], said: dict[int, str]
         ) -> tuple[Row, list[int]]:
    """A data row of the game, and the whole transcript of an episode that makes `guesses`
    (the environment's answers: `said`, by guess)."""
    ids = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    row = Row(guess.PROMPT, guess.PROMPT, tokenizer(guess.PROMPT).input_ids,
              {"secret": str(secret)})
    whole = list(row.tokens)
    for number in guesses:
        whole += ids(str(number)) + [EOS] + ids(said.get(number, ""))
    return row, whole


async def run_pool(pool: EpisodePool, policy: Policy, params: SamplingParams, rounds: int
                   ) -> None:
    for _ in range(rounds):
        await pool.advance(policy.generate, params)
        pool.version += 1


async def test_an_episode_and_its_environment_span_a_checkpoint(tokenizer):
    row, whole = game(tokenizer, 37, [50, 25, 37], {50: "lower", 25: "higher"})
    policy = Policy({tuple(row.tokens): whole})
    params = SamplingParams(max_new_tokens=3, stop_token_ids=(EOS,), seed=1)
    ran = pool_of(tokenizer, f"{GUESS}:Guess")
    ran.add([row], 0)
    await run_pool(ran, policy, params, 2)  # a guess and a half: the game under way
    [group] = ran.groups
    assert all(t.env.steps == 1 and not t.finished for t in group.samples)
    saved = json.loads(json.dumps(ran.state_dict()))  # what loop.json keeps
    await run_pool(ran, policy, params, 4)
    back = pool_of(tokenizer, f"{GUESS}:Guess")
    back.load_state_dict(saved)
    await run_pool(back, policy, params, 4)  # its Guess back by replay of the first step
    for whole_run, resumed in zip(group.samples, back.groups[0].samples, strict=True):
        assert resumed.ended == whole_run.ended == "done"
        assert resumed.tokens == whole_run.tokens == whole[len(row.tokens):]
        assert resumed.versions == whole_run.versions
        assert resumed.messages == whole_run.messages
        assert (resumed.env.steps, resumed.env.done) == (whole_run.env.steps, True) == (3, True)
        # the environment's words are never trained on, whichever round added them
        assert resumed.trained == [True] * 3 + [False] * 5 + [True] * 3 + [False] * 6 \
            + [True] * 3  # 50<eos> lower 25<eos> higher 37<eos>
    # the group's prompt: its first episode's opening (the row's prompt, as Guess opens)
    assert back.groups[0].samples[0].row.text == guess.PROMPT


class Guesses:
    """A stand-in model that writes "10" and its stop token at every turn."""

    def __init__(self, tokenizer) -> None:
        self.turn = tokenizer("10", add_special_tokens=False).input_ids + [EOS]

    async def generate(self, prompts, params, sessions, sticky, continuous=False):
        return [Completion(self.turn, [-0.5] * len(self.turn), stopped=True) for _ in prompts]


async def test_an_environment_a_replay_cannot_bring_back_must_keep_its_state(tokenizer,
                                                                            drawn):
    params = SamplingParams(max_new_tokens=3, stop_token_ids=(EOS,), seed=1)
    policy = Guesses(tokenizer)
    row = Row(guess.PROMPT, guess.PROMPT, tokenizer(guess.PROMPT).input_ids, {})

    async def saved_after_a_turn(cls: str) -> tuple[dict, list[int]]:
        pool = pool_of(tokenizer, cls, budget=3)
        pool.add([row], 0)
        await run_pool(pool, policy, params, 1)  # a turn, and the code it was answered
        return json.loads(json.dumps(pool.state_dict())), [t.env.env.code
                                                           for t in pool.groups[0].samples]

    saved, _ = await saved_after_a_turn(drawn("Drawn"))
    again = pool_of(tokenizer, drawn("Drawn"), budget=3)
    again.load_state_dict(saved)
    with pytest.raises(EnvError, match=r"Drawn on row .*replayed after a checkpoint, its step "
                                       r"1 answered .* must define state_dict\(\) and "
                                       r"load_state_dict\(state\)"):
        await run_pool(again, policy, params, 1)

    saved, codes = await saved_after_a_turn(drawn("Kept"))
    assert [t["env_saved"]["state"] for t in saved["groups"][0]["samples"]] \
        == [{"code": c} for c in codes]
    kept = pool_of(tokenizer, drawn("Kept"), budget=3)
    kept.load_state_dict(saved)
    await run_pool(kept, policy, params, 1)  # the second turn, answered with the same code
    ids = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    for t, code in zip(kept.groups[0].samples, codes, strict=True):
        assert t.env.env.code == code and t.env.steps == 2
        assert t.tokens == (policy.turn + ids(str(code))) * 2


async def test_the_guessing_game_in_partial_rollouts_resumes_as_it_never_stopped(tmp_path):
    guess.write(tmp_path / "data", train_size=64, eval_size=4)
    base = [*guess.overrides(tmp_path / "data"), "rollout.mode=partial",
            "rollout.max_tokens_per_step=4", "grpo.prompts_per_step=2",
            "grpo.max_completion_length=3", "rollout.max_turns=4", "run.eval_every=3"]

    async def run(out: Path, *overrides: str) -> list[dict]:
        cfg = load_config(overrides=[*base, f"run.out={out}", *overrides])
        await Loop(cfg).run()
        return json.loads((out / "metrics.json").read_text())["steps"]

    whole = await run(tmp_path / "whole", "run.steps=3", "run.save_every=0")
    await run(tmp_path / "stopped", "run.steps=2", "run.save_every=2")
    saved = LoopState.read(tmp_path / "stopped" / "checkpoints" / "step_00000002" / "loop.json")
    going = [s for g in saved.carried["groups"] for s in g["samples"] if not s["ended"]]
    assert any(s["env_saved"]["steps"] for s in going)  # games under way, stepped already
    resumed = await run(tmp_path / "stopped", "run.steps=3", "run.save_every=2",
                        "run.resume=auto")
    keys = ("reward", "loss", "finished_samples", "carried_samples", "env/steps",
            "env/done_share", "episode_ended", "partial/episodes_carried")
    assert [[s.get(k) for k in keys] for s in resumed] == [[s.get(k) for k in keys]
                                                            for s in whole]
    assert resumed[-1]["eval_reward"] == whole[-1]["eval_reward"]  # (the stop evaluated too)
    trained = whole[1:]
    assert sum(s["env/steps"] for s in trained) > 0
    assert sum(s["partial/episodes_carried"] for s in trained) > 0  # across steps

