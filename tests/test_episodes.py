"""Multi-turn episodes with tools: the model's turns, the tools' results through their own
service on real procs, the observations appended as the model reads them (the plain form of
the tiny model, and a chat template that renders tools, in the `tool` role), and a loss
that covers only what the model wrote.

The model's turns are scripted here (a stand-in `generate` that writes the turns a trained
model would), so that every path (a call, a bad call, a failing tool, an answer) is taken
for sure; the tools, the service, the tokenizers, the templates and the loss are real."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from bench.agentic import slow_tool
from colocate.engines.sampling import Completion, SamplingParams
from colocate.engines.tiny import write_tiny_model
from colocate.testing import start_runtime
from examples.rl_loop.batch import GRPOLoss, scored_batch
from examples.rl_loop.data import Row
from examples.rl_loop.episodes import AgentRollouts
from examples.rl_loop.grpo import GRPOConfig
from examples.rl_loop.rollouts import RolloutConfig
from examples.rl_loop.sources import Scored
from examples.rl_loop.tool_calls import plain_alphabet
from examples.rl_loop.tools import ToolClient, ToolsConfig, tool_schemas
from examples.rl_loop.transcripts import ChatTranscript, Transcript

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
CALCULATOR = f"{ROOT}/examples/rl_loop/tasks/multiply_tools.py:calculator"
EOS = "<eos>"


class Script:
    """A stand-in policy: each row's turns, written in order; it checks that every call
    asks to stop at the transcript's call-closing token."""

    def __init__(self, tokenizer, turns: dict[str, list[str]], stop_ids) -> None:
        self.tokenizer, self.turns, self.stop_ids = tokenizer, turns, stop_ids
        self.calls = 0
        self.budgets: list[int] = []

    def tokens(self, text: str) -> list[int]:
        ids = self.tokenizer(text.removesuffix(EOS), add_special_tokens=False).input_ids
        return ids + ([self.tokenizer.eos_token_id] if text.endswith(EOS) else [])

    async def generate(self, prompts: list[list[int]], params: SamplingParams
                       ) -> list[Completion]:
        assert set(self.stop_ids) <= set(params.stop_token_ids)
        self.calls += 1
        self.budgets.append(params.max_new_tokens)
        out = []
        for prompt in prompts:
            text = self.tokenizer.decode(prompt, skip_special_tokens=False)
            [row] = [r for r in self.turns if r in text]
            tokens = self.tokens(self.turns[row].pop(0))
            out.append(Completion(tokens, [-0.25] * len(tokens),
                                  stopped=tokens[-1] in params.stop_token_ids))
        return out


def rollouts(script: Script, transcript: Transcript, client: ToolClient, positions: int,
             **rollout) -> AgentRollouts:
    grpo = GRPOConfig(group_size=2, prompts_per_step=1)
    return AgentRollouts(None, script.generate, lambda i: None, grpo, 8,
                         RolloutConfig(**rollout), transcript, lambda: client, positions,
                         lambda tokens, params, *routing: script.generate(tokens, params))


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("plain") / "m", "qwen2",
                            alphabet="0123456789*=" + plain_alphabet(["calculator"]),
                            max_positions=64)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path), path


def row(tokenizer, prompt: str, chat: bool = False, tools=None) -> Row:
    if chat:
        messages = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=True)
        return Row(messages, text, tokenizer(text, add_special_tokens=False).input_ids, {})
    return Row(prompt, prompt, tokenizer(prompt).input_ids, {})


async def test_plain_episodes_call_the_tool_service_and_mask_its_results(plain):
    tokenizer, _ = plain
    cfg = ToolsConfig(funcs=[CALCULATOR], workers=2, timeout_s=5)
    transcript = Transcript(tokenizer, tool_schemas(cfg))
    rows = [row(tokenizer, p) for p in ("12*34=", "56*78=", "9*9=", "7*6=")]
    script = Script(tokenizer, {"12*34=": ["c(12*34)", "408" + EOS],
                                "56*78=": ["u(1)", "5" + EOS],  # no tool named u...: a bad call
                                "9*9=": ["calc(9*)", "0" + EOS],  # the tool raises
                                "7*6=": ["42" + EOS]}, transcript.stop_ids)
    async with start_runtime(gpus_per_host=1):
        client = await ToolClient.spawn(cfg)
        got = await rollouts(script, transcript, client, 64, max_turns=3,
                             bad_call_reward=-0.5).episodes(rows, SamplingParams(
                                 max_new_tokens=10, stop_token_ids=(tokenizer.eos_token_id,)),
                                 1)
    texts = [tokenizer.decode(c.tokens, skip_special_tokens=True) for c in got.completions]
    assert texts == ["c(12*34)[408]408", "u(1)[!]5", "calc(9*)[!]0", "42"]
    assert script.calls == 2  # one batched call a turn, for every episode still going
    observed = ["".join(tokenizer.decode([t]) for t, mine in zip(c.tokens, trained,
                                                               strict=True) if not mine)
                for c, trained in zip(got.completions, got.trained, strict=True)]
    assert observed == ["[408]", "[!]", "[!]", ""]
    assert all(lp == 0.0 for c, tr in zip(got.completions, got.trained, strict=True)
               for lp, mine in zip(c.logprobs, tr, strict=True) if not mine)
    assert got.extra_rewards == [0.0, -0.5, 0.0, 0.0]
    assert got.conversations == [None] * 4  # text rows: the reward reads the transcript
    m = got.metrics
    assert (m["episode_bad_calls"], m["episode_tool_errors"], m["tools/calls"]) == (1, 1, 2)
    assert m["episode_ended"] == {"answer": 4} and m["episode_turns_mean"] == 7 / 4
    assert m["tools/errors/raised"] == 1


async def test_an_episode_near_the_models_length_gets_a_call_of_its_own(plain):
    """Every row of a generate call must fit the model: an episode with less room than a
    whole turn is asked for what it has room for, in a call apart; the others keep theirs,
    and one that runs out of room ends as an overflow."""
    tokenizer, _ = plain
    transcript = Transcript(tokenizer, tool_schemas(ToolsConfig(funcs=[CALCULATOR])))
    rows = [row(tokenizer, "1*2="), row(tokenizer, "123456*7=")]
    script = Script(tokenizer, {"1*2=": ["2" + EOS], "123456*7=": ["86419"]},
                    transcript.stop_ids)
    positions = len(rows[1].tokens) + 5  # the long prompt has room for 5 tokens, not 10
    async with start_runtime(gpus_per_host=1):
        client = await ToolClient.spawn(ToolsConfig(funcs=[CALCULATOR]))
        got = await rollouts(script, transcript, client, positions, max_turns=2).episodes(
            rows, SamplingParams(max_new_tokens=10,
                                 stop_token_ids=(tokenizer.eos_token_id,)), 1)
    assert sorted(script.budgets) == [5, 10]
    assert [c.stopped for c in got.completions] == [True, False]
    assert got.metrics["episode_ended"] == {"answer": 1, "overflow": 1}


class Timed:
    """The tool client, its calls' windows recorded (monotonic start, end)."""

    def __init__(self, client: ToolClient) -> None:
        self.client, self.windows = client, []

    async def call(self, name, arguments):
        start = time.monotonic()
        try:
            return await self.client.call(name, arguments)
        finally:
            self.windows.append((start, time.monotonic()))

    def take_stats(self):
        return self.client.take_stats()


@pytest.mark.parametrize("cohorts", [1, 2, "continuous"])
async def test_one_cohort_decodes_while_another_waits_for_its_tools(plain, tmp_path, cohorts):
    """Two cohorts: a generate call starts while the other cohort's tool calls (50 ms
    each) are under way, and each cohort's calls are seeded from its first episode's index;
    in lockstep (one cohort), no generate call meets a tool call. Continuous: each
    episode's turn is a call of one row of its own, seeded from its index, asking to join
    the running batch. The episodes are the same either way (the script answers by row)."""
    tokenizer, _ = plain
    (tmp_path / "slow.py").write_text(slow_tool(50))
    cfg = ToolsConfig(funcs=[f"{tmp_path / 'slow.py'}:calculator"], workers=4, timeout_s=5)
    transcript = Transcript(tokenizer, tool_schemas(cfg))
    prompts = ("12*34=", "56*78=", "9*9=", "7*6=")
    script = Script(tokenizer, {p: [f"c({p[:-1]})", "1" + EOS] for p in prompts},
                    transcript.stop_ids)
    starts, seeds, joining = [], [], set()

    async def generate(tokens, params, sessions, sticky, continuous):
        starts.append(time.monotonic())
        seeds.append(params.seed)
        joining.add((len(tokens), continuous))
        return await script.generate(tokens, params)

    mode = {"continuous": True} if cohorts == "continuous" else {"cohorts": cohorts}

    async with start_runtime(gpus_per_host=1):
        client = Timed(await ToolClient.spawn(cfg))
        agent = rollouts(script, transcript, client, 64, max_turns=2, **mode)
        agent.generate_turns = generate
        got = await agent.episodes([row(tokenizer, p) for p in prompts], SamplingParams(
            max_new_tokens=10, stop_token_ids=(tokenizer.eos_token_id,), seed=100), 1)
    texts = [tokenizer.decode(c.tokens, skip_special_tokens=True) for c in got.completions]
    assert texts == ["c(12*34)[408]1", "c(56*78)[4368]1", "c(9*9)[81]1", "c(7*6)[42]1"]
    during = [t for t in starts if any(a < t < b for a, b in client.windows)]
    turn = 15_485_863  # episodes.TURN_SEED
    if cohorts == "continuous":
        assert len(client.windows) == 4 and len(starts) == 8 and joining == {(1, True)}
        assert during and sorted(seeds) == [100 + t + i for t in (0, turn) for i in range(4)]
        return
    assert len(client.windows) == 4 and len(starts) == 2 * cohorts
    assert joining == {(4 // cohorts, False)}
    if cohorts == 1:
        assert not during and seeds == [100, 100 + turn]
    else:
        assert during
        assert sorted(seeds) == [100, 102, 100 + turn, 102 + turn]


def test_the_loss_never_scores_an_observation_token(plain):
    """The targets at observation positions changed (the tool said something else): the
    loss and every gradient are the same; one of the model's own tokens changed: they are
    not."""
    tokenizer, path = plain
    from transformers import AutoModelForCausalLM

    prompt = tokenizer("12*34=").input_ids
    written = tokenizer("c(12*34)", add_special_tokens=False).input_ids
    shown = tokenizer("[408]", add_special_tokens=False).input_ids
    answer = tokenizer("408", add_special_tokens=False).input_ids
    tokens = written + shown + answer
    trained = [True] * len(written) + [False] * len(shown) + [True] * len(answer)
    completion = Completion(tokens, [-1.0] * len(tokens), stopped=True)
    from examples.rl_loop.rollouts import Rollout

    rollout = Rollout([], [prompt, prompt], [completion, completion], {},
                      trained=[trained, trained])
    batch, _ = scored_batch([prompt, prompt], [completion, completion],
                            Scored([1.0, 0.0]), GRPOConfig(group_size=2), 0)
    AgentRollouts.finish_batch(None, rollout, batch)
    start = len(prompt) - 1
    assert batch["mask"][0, start:start + len(tokens)].tolist() == [float(t) for t in trained]

    def loss_and_grads(targets: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(path)
        loss, _ = GRPOLoss(GRPOConfig(group_size=2))(model, {**batch, "targets": targets})
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    base, grads = loss_and_grads(batch["targets"])
    other = batch["targets"].clone()
    where = [start + len(written) + i for i in range(len(shown))]
    other[:, where] = tokenizer("7", add_special_tokens=False).input_ids[0]
    changed, changed_grads = loss_and_grads(other)
    assert changed == base
    assert all(torch.equal(a, b) for a, b in zip(grads, changed_grads, strict=True))
    mine = batch["targets"].clone()
    mine[:, start] = tokenizer("7", add_special_tokens=False).input_ids[0]
    assert loss_and_grads(mine)[0] != base  # the check can fail


TEMPLATE = (
    "{% if tools %}<|im_start|>system"
    "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<|im_end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user<tool_response>{{ m.content }}"
    "</tool_response><|im_end|>"
    "{% else %}<|im_start|>{{ m.role }}{{ m.content }}<|im_end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{% endif %}")
SPECIAL = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
           "</tool_response>"]


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """A Qwen2-shaped model whose tokenizer's chat template renders tools and `tool`
    messages, its markup special tokens of their own, `<|im_end|>` its end of turn (no
    newlines: the character tokenizer has none)."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    schemas = tool_schemas(ToolsConfig(funcs=[CALCULATOR]))
    alphabet = sorted(set(json.dumps(schemas) + "0123456789*= abcdefghijklmnopqrstuvwxyz"
                          "ABCDEFGHIJKLMNOPQRSTUVWXYZ\n{}[]\":,.?!'"))
    path = write_tiny_model(tmp_path_factory.mktemp("chat") / "m", "qwen2",
                            alphabet="".join(alphabet), max_positions=4096)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": [
        AddedToken(t, special=True) for t in SPECIAL]})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path), schemas


async def test_a_chat_episode_renders_tools_and_results_in_the_tool_role(chat):
    tokenizer, schemas = chat
    prompt = row(tokenizer, "What is 12*34?", chat=True, tools=schemas)
    assert '"name": "calculator"' in prompt.text  # the tools, as the template shows them
    transcript = ChatTranscript(tokenizer, schemas, "hermes")
    call = '<tool_call>{"name":"calculator","arguments":{"expression":"12*34"}}</tool_call>'
    script = Script(tokenizer, {"12*34?": [call, "408." + EOS]}, transcript.stop_ids)
    async with start_runtime(gpus_per_host=1):
        client = await ToolClient.spawn(ToolsConfig(funcs=[CALCULATOR]))
        got = await rollouts(script, transcript, client, 4096, max_turns=3).episodes(
            [prompt], SamplingParams(max_new_tokens=200,
                                     stop_token_ids=(tokenizer.eos_token_id,)), 1)
    [completion], [trained] = got.completions, got.trained
    text = tokenizer.decode(completion.tokens, skip_special_tokens=False)
    shown = ("<|im_end|><|im_start|>user<tool_response>408</tool_response><|im_end|>"
             "<|im_start|>assistant")
    assert text == call + shown + "408.<|im_end|>"
    observed = tokenizer.decode([t for t, mine in zip(completion.tokens, trained, strict=True)
                                 if not mine], skip_special_tokens=False)
    assert observed == shown  # the template's own tokens and the result: none trained
    [messages] = got.conversations
    assert [m["role"] for m in messages] == ["assistant", "tool", "assistant"]
    assert messages[0]["tool_calls"][0]["function"] == {
        "name": "calculator", "arguments": {"expression": "12*34"}}
    assert messages[1]["content"] == "408" and messages[2]["content"] == "408."


def test_cohorts_are_refused_with_partial_rollouts() -> None:
    with pytest.raises(ValueError, match=r"^rollout\.cohorts=2 with rollout\.mode=partial"):
        RolloutConfig(mode="partial", cohorts=2)
    assert RolloutConfig(cohorts=2).cohorts == 2
