"""Multi-turn, tool-using rollouts: each GRPO sample is an episode, not one completion.

An episode starts from its row's prompt; the model writes until it calls a tool (its turn
ends at the call's closing token) or ends its answer (its stop token). The calls are parsed
(`tool_calls`: the chat template's form for a model with one, the plain form for the tiny
character model), run in the tools' own service (`tools.ToolClient`: an error is an
observation, never a crash), and their results appended as observation tokens, rendered
the way the model reads them (`transcripts.Transcript`); then the model goes on, up to
`rollout.max_turns` turns and `rollout.max_trajectory_tokens` tokens after the prompt (an
overflow ends the episode, counted). The loss covers only the tokens the model wrote:
every observation and template token is masked (`Rollout.trained`).

The episodes of a step run in `rollout.cohorts` cohorts (consecutive groups of them), each
turn by turn: one batched generate call for every episode of the cohort still going, then
all their tool calls at once (as many at a time as there are tool workers), so a turn costs
one decoding pass and the slowest of its tool calls, not one of each per episode; and while
one cohort waits for its tools, another decodes. A cohort's batches are the same for the
same seed, whatever the tools' timing (each cohort's calls are seeded from its first
episode's index): the same seed gives the same run. With `rollout.continuous` each episode
runs on its own instead (a cohort of one): a generate call a turn, its tool calls as soon as
it made them, every call joining the generator's running batch (continuous batching:
`GeneratorActor.generate_continuous`), which keeps the batch full while some episodes wait
for tools; with the torch engine a row's tokens depend on the row alone there, so it too is
the same run for the same seed (with vLLM only as far as its kernels give a row the same
numbers whatever its companions: not bitwise on CPU). The reward functions get the whole
conversation: the messages after the prompt (chat rows), or the transcript's text (text
rows).

With an environment (`env.cls`), each episode has an instance of its own: its `reset`
messages are the prompt, a turn that ends at its stop token without a tool call goes to its
`step`, whose observations are appended as a tool's results are, and `done` ends the
episode (`envs.py` tells the rules). With partial rollouts, episodes with tools span steps
as items of the carried pool (`partial_episodes.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import torch

from colocate.engines.sampling import Completion, PrefixCounts, SamplingParams
from examples.rl_loop.data import Row
from examples.rl_loop.envs import Environments, env_metrics
from examples.rl_loop.episode_figures import episode_metrics, prefix_metrics
from examples.rl_loop.grpo import GRPOConfig
from examples.rl_loop.rollouts import Generate, Rollout, RolloutConfig, Rollouts, Score
from examples.rl_loop.tool_calls import ParsedTurn, observations
from examples.rl_loop.transcripts import Episode, Transcript

# the loop's `Runtime.generate_turns`: prompts, params, each row's session, sticky,
# continuous (the rows join the generator's running batch)
GenerateTurns = Callable[[list[list[int]], SamplingParams, list[str], bool, bool],
                         Awaitable[list[Completion]]]
TURN_SEED = 15_485_863  # turn t of a step samples with the step's seed + t times this


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
        """`copies` episodes per row, run turn by turn to their ends (in cohorts, or each
        on its own with `rollout.continuous`: see module)."""
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
        size = 1 if self.cfg.continuous else max(1, -(-len(episodes) // self.cfg.cohorts))
        await asyncio.gather(*(self._cohort(episodes[first:first + size], params, first)
                               for first in range(0, len(episodes), size)))
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

    async def _cohort(self, episodes: list[Episode], params: SamplingParams, first: int
                      ) -> None:
        """A cohort's episodes (the step's from index `first`), turn by turn to their ends."""
        for turn in range(self.cfg.max_turns):
            going = [e for e in episodes if not e.ended]
            if not going:
                break
            await self._turn(going, params, turn, first)

    async def _turn(self, going: list[Episode], params: SamplingParams, turn: int,
                    first: int) -> None:
        """One turn of a cohort's episodes still going: a generate call, then their tool
        calls."""
        rooms = [self.room(e) for e in going]
        for episode, room in zip(going, rooms, strict=True):
            if room <= 0:
                episode.ended = "overflow"
        asked = [(e, r) for e, r in zip(going, rooms, strict=True) if r > 0]
        if not asked:
            return
        completions = await self._generate(asked, params, turn, first)
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
                             *(self.step_env(e) for e in stepping))

    async def _generate(self, asked: list[tuple[Episode, int]], params: SamplingParams,
                        turn: int, first: int) -> list[Completion]:
        """The turn's completions: one call for the episodes with room for a whole turn
        (the usual), one per shorter room (a call's every row must fit the model)."""
        seed = None if params.seed is None else params.seed + TURN_SEED * turn + first
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
                [asked[i][0].session for i in which], self.sticky, self.cfg.continuous)
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

    async def step_env(self, episode: Episode) -> None:
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

