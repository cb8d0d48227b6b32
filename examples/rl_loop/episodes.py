"""Multi-turn, tool-using rollouts: each GRPO sample is an episode, not one completion.

An episode starts from its row's prompt; the model writes until it calls a tool (its turn
ends at the call's closing token) or ends its answer (its stop token). The calls are parsed
(`tool_calls`: the chat template's form for a model with one, the plain form for the tiny
character model), run in the tools' own service (`tools.ToolClient`: an error is an
observation, never a crash), and their results appended as observation tokens, rendered the
way the model reads them (`Transcript`); then the model goes on, up to `rollout.max_turns`
turns and `rollout.max_trajectory_tokens` tokens after the prompt (an overflow ends the
episode, counted). The loss covers only the tokens the model wrote: every observation and
template token is masked (`Rollout.trained`).

All the episodes of a step run together, turn by turn: one batched generate call for every
episode still going, then all their tool calls at once (as many at a time as there are tool
workers), so a turn costs one decoding pass and the slowest of its tool calls, not one of
each per episode. A turn's batch is the same for the same seed, whatever the tools' timing:
the same seed gives the same run. The reward functions get the whole conversation: the
messages after the prompt (chat rows), or the transcript's text (text rows).

With an environment (`env.cls`), each episode has an instance of its own: its `reset`
messages are the prompt, a turn that ends at its stop token without a tool call goes to its
`step`, whose observations are appended as a tool's results are, and `done` ends the
episode (`envs.py` tells the rules). With partial rollouts, episodes with tools span steps
as items of the carried pool (`partial_episodes.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from colocate.engines.sampling import Completion, PrefixCounts, SamplingParams
from examples.rl_loop.data import Row
from examples.rl_loop.envs import Environments, EpisodeEnv, Message, contents, env_metrics
from examples.rl_loop.episode_figures import episode_metrics, prefix_metrics
from examples.rl_loop.grpo import GRPOConfig
from examples.rl_loop.rollouts import Generate, Rollout, RolloutConfig, Rollouts, Score
from examples.rl_loop.tool_calls import (
    ParsedTurn,
    observations,
    parse_hermes,
    parse_plain,
    parse_template,
    render_plain,
)

# the loop's `Runtime.generate_turns`: prompts, params, each row's session, sticky
GenerateTurns = Callable[[list[list[int]], SamplingParams, list[str], bool],
                         Awaitable[list[Completion]]]
TURN_SEED = 15_485_863  # turn t of a step samples with the step's seed + t times this


@dataclass
class Episode:
    """One sample's conversation after its prompt: the tokens, whether the model wrote
    each (and its log-probability there), the messages, and what happened."""

    row: Row
    session: str  # its id: its turns go to the replica that holds its KV prefix
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    trained: list[bool] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)  # for the reward functions
    said: list[dict[str, Any]] = field(default_factory=list)  # as the template renders them
    turns: int = 0
    calls: int = 0
    bad_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0
    computed: int = 0  # tokens whose keys and values a turn computed, from the prompt's start
    ended: str = ""  # answer (its stop token), length, max_turns, overflow; done, env_error
    env: EpisodeEnv | None = None  # env.cls: its own instance

    def add(self, tokens: list[int], logprobs: list[float] | None = None) -> None:
        """Tokens the model wrote (with their log-probabilities) or an observation's."""
        self.tokens += tokens
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)
        self.trained += [logprobs is not None] * len(tokens)

    def completion(self) -> Completion:
        return Completion(list(self.tokens), list(self.logprobs),
                          stopped=self.ended in ("answer", "done"), finished=True)


class Transcript:
    """How a turn's text becomes tool calls and their results (or an environment's
    messages) become the tokens the model reads next: the plain form, for a tokenizer
    without a chat template (the tiny model). Without tools, a turn has no calls."""

    def __init__(self, tokenizer: Any, schemas: list[dict[str, Any]]) -> None:
        self.tokenizer, self.schemas = tokenizer, schemas
        self.stop_ids = (self._token(")"),) if schemas else ()  # a plain call ends at its ")"

    def _token(self, text: str) -> int:
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) != 1:
            raise ValueError(f"the model's tokenizer writes {text!r} as {len(ids)} tokens: "
                             "a tool call's end must be one token to stop a turn at it")
        return ids[0]

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def said_text(self, text: str) -> str:
        """A turn's text as its assistant message holds it."""
        return text

    def parse(self, episode: Episode, text: str) -> ParsedTurn:
        return parse_plain(text, self.schemas) if self.schemas else ParsedTurn(text.strip())

    def observation(self, episode: Episode, turn: ParsedTurn, text: str,
                    results: list[Any]) -> list[int]:
        """The observation's tokens: each result's text between brackets (`[!]`: failed)."""
        shown = "".join(render_plain(r.content, r.error) for r in results)
        shown += "".join(render_plain("", "bad") for _ in turn.bad)
        return self.tokenizer(shown, add_special_tokens=False).input_ids

    def opening(self, messages: list[Message]) -> tuple[Any, str, list[int]]:
        """An environment's opening as a prompt, text and tokens (`Row`'s): their contents
        one after another, read as a text row's prompt is (special tokens added)."""
        text = contents(messages)
        return text, text, self.tokenizer(text).input_ids

    def env_observation(self, episode: Episode, messages: list[Message]) -> list[int]:
        """An environment's observation messages as tokens: their contents as they are."""
        return self.tokenizer(contents(messages), add_special_tokens=False).input_ids


class ChatTranscript(Transcript):
    """The chat template's form: calls in Hermes' `<tool_call>` markup (or the tokenizer's
    own response parser), results as `tool` messages rendered by the template. The
    observation is what the template writes after the model's own tokens: the end of the
    assistant turn, the tool messages and the next turn's opening."""

    def __init__(self, tokenizer: Any, schemas: list[dict[str, Any]], form: str) -> None:
        self.tokenizer, self.schemas, self.form = tokenizer, schemas, form
        self.stop_ids = (self._token("</tool_call>"),) if schemas else ()

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    def said_text(self, text: str) -> str:
        """Without the end-of-turn token: the template writes it after the content."""
        return text.removesuffix(self.tokenizer.eos_token or "")

    def parse(self, episode: Episode, text: str) -> ParsedTurn:
        text = self.said_text(text)
        if not self.schemas:
            return ParsedTurn(text.strip())
        if self.form == "template":
            return parse_template(self.tokenizer, text, episode.row.text, self.schemas)
        return parse_hermes(text)

    def observation(self, episode: Episode, turn: ParsedTurn, text: str,
                    results: list[Any]) -> list[int]:
        return self._after(episode, observations(turn, [r.content for r in results]))

    def opening(self, messages: list[Message]) -> tuple[Any, str, list[int]]:
        """The chat template's rendering, as a chat row's prompt is."""
        text = self.tokenizer.apply_chat_template(messages, tools=self.schemas or None,
                                                  tokenize=False, add_generation_prompt=True)
        return list(messages), text, self.tokenizer(text, add_special_tokens=False).input_ids

    def env_observation(self, episode: Episode, messages: list[Message]) -> list[int]:
        return self._after(episode, messages)

    def _after(self, episode: Episode, shown: list[Message]) -> list[int]:
        """The tokens the template writes after the model's own for `shown` messages."""
        said = [*episode.said, *shown]
        rendered = self.tokenizer.apply_chat_template(
            [*episode.row.prompt, *said], tools=self.schemas or None, tokenize=False,
            add_generation_prompt=True)
        written = episode.row.text + self.decode(episode.tokens)
        if not rendered.startswith(written):
            raise ValueError("the chat template does not render the conversation as the "
                             f"model wrote it: {written[-80:]!r} is not a prefix of "
                             f"{rendered[len(episode.row.text):][:160]!r}; use a template "
                             "that renders an assistant message's content as it is")
        episode.said = said
        return self.tokenizer(rendered[len(written):], add_special_tokens=False).input_ids


def make_transcript(tokenizer: Any, schemas: list[dict[str, Any]], form: str) -> Transcript:
    """`rollout.tool_format`'s transcript: auto is the chat template's form where the
    tokenizer has a chat template, else the plain one."""
    if form == "plain" or form == "auto" and not getattr(tokenizer, "chat_template", None):
        return Transcript(tokenizer, schemas)
    return ChatTranscript(tokenizer, schemas, "hermes" if form == "auto" else form)


class AgentRollouts(Rollouts):
    """Episodes with tools or an environment (see module), `rollout.mode=sync`: each
    step's groups of episodes run to their ends (with `grpo.dynamic_sampling`,
    `Rollouts.dynamic`'s rounds of them). `tools()` is the tools' client (None: none)."""

    def __init__(self, source: Any, generate: Generate,
                 sampling: Callable[[int], SamplingParams], grpo: GRPOConfig, max_batch: int,
                 rollout: RolloutConfig, transcript: Transcript, tools: Callable[[], Any],
                 max_positions: int, generate_turns: GenerateTurns,
                 score: Score | None = None, envs: Environments | None = None) -> None:
        super().__init__(source, generate, sampling, grpo, max_batch, score)
        self.cfg, self.transcript, self.tools, self.envs = rollout, transcript, tools, envs
        self.max_positions, self.generate_turns = max_positions, generate_turns
        self.sticky = True  # each episode's turns on its replica (a benchmark turns it off)
        self.calls = 0  # episodes() calls so far: each episode's session id is unique
        self.prefix = PrefixCounts()  # this call's turns: their earlier tokens reused or not

    async def episodes(self, rows: list[Row], params: SamplingParams, copies: int
                       ) -> Rollout:
        """`copies` episodes per row, run together turn by turn to their ends."""
        self.calls, self.prefix = self.calls + 1, PrefixCounts()
        episodes = [Episode(row, f"e{self.calls}-{i}")
                    for i, row in enumerate(r for r in rows for _ in range(copies))]
        if self.envs is not None:  # each its own instance; its opening, the prompt
            opened = await asyncio.gather(*(self.envs.open(
                e.row, self.transcript.opening, self.max_positions) for e in episodes))
            for episode, (env, row) in zip(episodes, opened, strict=True):
                episode.env, episode.row = env, row
        client = self.tools()
        if client is not None:
            client.take_stats()  # this call's counts from here
        for turn in range(self.cfg.max_turns):
            going = [e for e in episodes if not e.ended]
            if not going:
                break
            await self._turn(going, params, turn)
        for episode in episodes:
            episode.ended = episode.ended or "max_turns"
        metrics = episode_metrics(episodes)
        if client is not None:
            metrics.update(client.take_stats().metrics())
        if self.envs is not None:
            metrics.update(env_metrics([e.env for e in episodes]))
        return Rollout([episodes[i * copies].row for i in range(len(rows))],
                       [e.row.tokens for e in episodes],
                       [e.completion() for e in episodes],
                       {**metrics, **prefix_metrics(self.prefix)},
                       trained=[e.trained for e in episodes],
                       conversations=[e.messages if e.row.chat else None for e in episodes],
                       extra_rewards=[self.cfg.bad_call_reward if e.bad_calls else 0.0
                                      for e in episodes],
                       episodes=episodes)

    def merged_metrics(self, rounds: list[Rollout], kept: Rollout) -> dict[str, Any]:
        """A dynamically sampled step's figures: the episodes' over those kept (what is
        trained on); the tools' calls, the environments' steps and the prefix reuse over
        every round's (the work done), and finished_samples counts every episode run."""
        tools: dict[str, Any] = {}
        for rollout in rounds:
            for key, value in rollout.metrics.items():
                if key.startswith("tools/"):
                    tools[key] = tools.get(key, 0) + value
        if "tools/seconds" in tools:
            tools["tools/seconds"] = round(tools["tools/seconds"], 4)
        if self.envs is not None:
            tools.update(env_metrics([e.env for r in rounds for e in r.episodes]))
        prefix = PrefixCounts(0, *(sum(r.metrics[key] for r in rounds) for key in
                                   ("prefix_reused_tokens", "prefix_recomputed_tokens")))
        return {**episode_metrics(kept.episodes),
                "finished_samples": sum(len(r.completions) for r in rounds),
                **tools, **prefix_metrics(prefix)}

    def room(self, episode: Episode) -> int:
        """New tokens the episode may still have (its length limit, the model's positions)."""
        limit = self.cfg.max_trajectory_tokens or self.max_positions
        return min(limit - len(episode.tokens),
                   self.max_positions - len(episode.row.tokens) - len(episode.tokens))

    async def _turn(self, going: list[Episode], params: SamplingParams, turn: int) -> None:
        """One turn of every episode still going: a generate call, then their tool calls."""
        rooms = [self.room(e) for e in going]
        for episode, room in zip(going, rooms, strict=True):
            if room <= 0:
                episode.ended = "overflow"
        asked = [(e, r) for e, r in zip(going, rooms, strict=True) if r > 0]
        if not asked:
            return
        completions = await self._generate(asked, params, turn)
        for (episode, _), new in zip(asked, completions, strict=True):
            # of the tokens it computed in its earlier turns, those the replica still had
            reused = new.prefix.reused if new.prefix is not None else 0
            self.prefix += PrefixCounts(len(episode.row.tokens) + len(episode.tokens), reused,
                                        max(0, episode.computed - reused))
        calling, stepping = [], []
        for (episode, room), new in zip(asked, completions, strict=True):
            kept = min(room, len(new.tokens))
            episode.add(new.tokens[:kept], new.logprobs[:kept])
            # keys and values computed: the prompt so far and all but the last token sampled
            episode.computed = len(episode.row.tokens) + len(episode.tokens) - 1
            episode.turns += 1
            text = self.transcript.decode(new.tokens[:kept])
            parsed = self.transcript.parse(episode, text)
            episode.messages.append(parsed.as_message())
            episode.said.append({"role": "assistant", "content": self.transcript.said_text(text)})
            last = new.tokens[kept - 1] if kept else None
            if parsed.has_calls and last not in params.stop_token_ids:
                calling.append((episode, parsed, text))
            elif last in (*params.stop_token_ids, *self.transcript.stop_ids):  # no call
                if episode.env is None:
                    episode.ended = "answer"
                else:
                    stepping.append(episode)
            else:
                episode.ended = "overflow" if kept == room else "length"
        unread = turn + 1 == self.cfg.max_turns  # the last turn's calls would go unread
        await asyncio.gather(*(self._call_tools(*c) for c in calling if not unread),
                             *(self._step_env(e) for e in stepping))

    async def _generate(self, asked: list[tuple[Episode, int]], params: SamplingParams,
                        turn: int) -> list[Completion]:
        """The turn's completions: one call for the episodes with room for a whole turn
        (the usual), one per shorter room (a call's every row must fit the model)."""
        seed = None if params.seed is None else params.seed + TURN_SEED * turn
        call = replace(params, seed=seed,
                       stop_token_ids=(*params.stop_token_ids, *self.transcript.stop_ids))
        by_budget: dict[int, list[int]] = {}
        for i, (_, room) in enumerate(asked):
            by_budget.setdefault(min(params.max_new_tokens, room), []).append(i)
        out: list[Completion] = [None] * len(asked)  # type: ignore[list-item]

        async def rows(budget: int, which: list[int]) -> None:
            got = await self.generate_turns(
                [asked[i][0].row.tokens + asked[i][0].tokens for i in which],
                replace(call, max_new_tokens=budget,
                        seed=None if seed is None else seed + which[0]),
                [asked[i][0].session for i in which], self.sticky)
            for i, completion in zip(which, got, strict=True):
                out[i] = completion

        await asyncio.gather(*(rows(b, which) for b, which in sorted(by_budget.items())))
        return out

    async def _call_tools(self, episode: Episode, parsed: ParsedTurn, text: str) -> None:
        self.observe(episode, parsed, text, await self.tool_results(parsed))

    async def tool_results(self, parsed: ParsedTurn) -> list[Any]:
        """The turn's calls, at once: their `ToolResult`s."""
        client = self.tools()
        return list(await asyncio.gather(*(client.call(c.name, c.arguments)
                                           for c in parsed.calls)))

    def observe(self, episode: Episode, parsed: ParsedTurn, text: str, results: list[Any]
                ) -> None:
        """The turn's call results appended as the observation, and counted."""
        episode.calls += len(parsed.calls)
        episode.bad_calls += len(parsed.bad)
        episode.tool_errors += sum(r.error is not None for r in results)
        episode.tool_seconds += sum(r.seconds for r in results)
        episode.messages += observations(parsed, [r.content for r in results])
        episode.add(self.transcript.observation(episode, parsed, text, results))

    async def _step_env(self, episode: Episode) -> None:
        """The environment's step on the turn's assistant message: its observations
        appended (room permitting), its `done` or its failure the episode's end."""
        shown = await episode.env.step(dict(episode.messages[-1]))
        if shown is None or episode.env.done:
            episode.ended = "env_error" if shown is None else "done"
        if not shown:  # nothing to read (a template would open a turn all the same)
            return
        tokens = self.transcript.env_observation(episode, shown)
        if len(tokens) > self.room(episode):
            episode.ended = episode.ended or "overflow"
            return
        episode.messages += shown
        episode.add(tokens)

    def finish_batch(self, rollout: Rollout, batch: dict[str, torch.Tensor]) -> float | None:
        """Only the model's own tokens are trained on: the observations' are masked."""
        for row, (prompt, trained) in enumerate(zip(rollout.tokens, rollout.trained or [],
                                                    strict=True)):
            start = len(prompt) - 1
            written = torch.tensor(trained, dtype=batch["mask"].dtype)
            batch["mask"][row, start:start + len(trained)] *= written
        return None

