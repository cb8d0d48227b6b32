"""Multi-turn episodes in partial rollouts (`rollout.mode=partial` with `tools.funcs` or
`env.cls`): an
episode (`transcripts.Episode`) is an item of the partial pool, as a carried completion is, so a
trajectory may span steps, switches and checkpoints.

An episode under way (`Trajectory`) keeps what it needs to go on: its tokens so far (the
model's and the observations'), which of them the model wrote (the loss's mask: an
observation or template token is never trained on, whichever step added it), each token's
behaviour log-probability and the policy version that sampled it, its messages, its turn
and tool counters, where its turn in progress began, and the turn whose tool calls it waits
for. A round (`EpisodePool.advance`) gives every unfinished episode up to
`rollout.max_tokens_per_step` tokens of its own writing (observations cost none), in
lockstep sub-rounds as `episodes.AgentRollouts` runs turns: the tool results waited for
read, then one generate call for every episode with budget left, and again. A turn cut by
the budget goes on at the next round from where it stopped (its prompt: the episode so
far, on the weights the generator holds then); a turn that ends at a tool call as its
budget runs out leaves the call under way: started at once, it runs across the switch and
the training, and its results are read at the next round's start.

The pool is in the checkpoint (`state_dict`): a call under way is kept as the turn that
asked for it, made again on resume (tools are stateless), and read at the same point of
the run either way; a step's tool figures count the results as they are read, not as the
calls end. So the same seed gives the same run, and a resumed run (or one restarted after
a killed proc) is the run never stopped.

With an environment (`env.cls`), an episode's instance is made and reset at the first
round that advances it (its opening becomes the episode's prompt), and a turn that ends at
its stop token without a tool call is stepped within the round, as `episodes.AgentRollouts`
steps one (an environment's step never spans a switch). A checkpoint keeps each episode's
environment as `envs.EpisodeEnv.saved` has it; after a resume the instance comes back at
the first round by its class's `load_state_dict`, else by replaying its steps
(`envs.Environments.restore`).
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from colocate.engines.sampling import Completion, PrefixCounts, SamplingParams
from examples.rl_loop.data import Row
from examples.rl_loop.envs import env_metrics
from examples.rl_loop.episode_figures import episode_metrics, prefix_metrics
from examples.rl_loop.episodes import TURN_SEED, AgentRollouts, GenerateTurns
from examples.rl_loop.grpo import GRPOConfig
from examples.rl_loop.partial import PartialRollouts, generate_step
from examples.rl_loop.pool import Group, Pool
from examples.rl_loop.rollouts import Rollout, RolloutConfig, decode_slots
from examples.rl_loop.tools import ToolStats
from examples.rl_loop.transcripts import Episode


@dataclass
class Trajectory(Episode):
    """An episode under way in the pool (see module)."""

    versions: list[int] = field(default_factory=list)  # each token's policy version
    turn_start: int | None = None  # where its turn in progress began (None: between turns)
    pending: str | None = None  # the text of the turn whose tool calls it waits for
    env_saved: dict[str, Any] | None = None  # its environment as a checkpoint kept it

    @property
    def finished(self) -> bool:
        return bool(self.ended)

    def completion(self) -> Completion:
        return replace(super().completion(), versions=list(self.versions))

    def stamp(self, version: int) -> None:
        """The tokens added since the last stamp: of policy version `version`."""
        self.versions += [version] * (len(self.tokens) - len(self.versions))

    def turn(self) -> list[int]:
        """The tokens of its turn in progress."""
        return [] if self.turn_start is None else self.tokens[self.turn_start:]


class EpisodePool(Pool):
    """The carried groups of episodes (see module). `agent` lends its transcript, its tools
    and the episodes' limits."""

    def __init__(self, cfg: RolloutConfig, group_size: int, max_new_tokens: int,
                 max_batch: int, agent: AgentRollouts) -> None:
        super().__init__(cfg, group_size, max_new_tokens, max_batch)
        self.agent = agent
        self.under_way: dict[str, asyncio.Future] = {}  # an episode's calls, by session
        self.tools, self.prefix = ToolStats(), PrefixCounts()  # since the last take

    def add(self, rows: list[Row], step: int) -> None:
        self.groups += [Group(row, step, [Trajectory(row, f"p{step}-{i}-{j}")
                                          for j in range(self.group_size)])
                        for i, row in enumerate(rows)]

    async def advance(self, generate: GenerateTurns, params: SamplingParams,
                      groups: list[Group] | None = None, finish: bool = False
                      ) -> dict[str, int] | None:
        """One round (see module) of every unfinished episode (of `groups`, default all):
        `rollout.max_tokens_per_step` tokens of its own at most (`finish`: to its end).
        Returns the tokens the model wrote, the rows' decode slots and the generate calls
        made, or None when no episode is left."""
        groups = self.groups if groups is None else groups
        going = [t for g in groups for t in g.samples if not t.finished]
        if not going:
            return None
        if self.agent.envs is not None:
            await self._environments(groups)
        budget = math.inf if finish else self.cfg.max_tokens_per_step
        spent = dict.fromkeys((t.session for t in going), 0)
        figures = {"tokens": 0, "slots": 0, "calls": 0}
        for sub in itertools.count():
            await asyncio.gather(*(self._read(t) for t in going
                                   if t.pending is not None and spent[t.session] < budget))
            asked = [t for t in going if not t.ended and t.pending is None
                     and spent[t.session] < budget]
            for t in asked:
                if self.agent.room(t) <= 0:
                    t.ended = "overflow"
            asked = [t for t in asked if not t.ended]
            if not asked:
                break
            caps = [min(budget - spent[t.session], self.agent.room(t),
                        self.max_new_tokens - len(t.turn())) for t in asked]
            completions = await self._generate(generate, asked, caps, params, sub, figures)
            stepping = []
            for t, cap, new in zip(asked, caps, completions, strict=True):
                kept = self._take(t, cap, new, params)
                spent[t.session] += kept
                figures["tokens"] += kept
                if t.ended == "answer" and t.env is not None:  # its environment answers
                    t.ended = ""
                    stepping.append(t)
            await asyncio.gather(*(self._step_env(t) for t in stepping))
        return figures

    async def _environments(self, groups: list[Group]) -> None:
        """Each episode of `groups` with its environment: opened on its group's data row
        (its prompt, the opening), or back from a checkpoint's (see module)."""
        envs, transcript = self.agent.envs, self.agent.transcript

        async def ready(group: Group, t: Trajectory) -> None:
            if t.env_saved is None:
                t.env, t.row = await envs.open(group.row, transcript.opening,
                                               self.agent.max_positions)
            else:
                t.env = await envs.restore(group.row, t.env_saved, t.finished)
                t.env_saved = None

        await asyncio.gather(*(ready(g, t) for g in groups for t in g.samples
                               if t.env is None))

    async def _step_env(self, t: Trajectory) -> None:
        """The environment's step on `t`'s answer, as the sync mode's; the observation's
        tokens stamped with the version of the turn they follow."""
        await self.agent.step_env(t)
        if t.ended == "" and t.turns == self.cfg.max_turns:
            t.ended = "max_turns"
        t.stamp(self.version)

    async def _generate(self, generate: GenerateTurns, asked: list[Trajectory],
                        caps: list[int], params: SamplingParams, sub: int,
                        figures: dict[str, int]) -> list[Completion]:
        """A sub-round's completions: each episode continued from its tokens so far, as
        many rows in one call as fit the model's positions asked for the largest cap."""
        seed = params.seed + TURN_SEED * sub
        call = replace(params, seed=seed, stop_token_ids=(*params.stop_token_ids,
                                                          *self.agent.transcript.stop_ids))
        prompts = [t.row.tokens + t.tokens for t in asked]
        by_fit: dict[int, list[int]] = {}
        for i, prompt in enumerate(prompts):
            fit = min(max(caps), self.agent.max_positions - len(prompt))
            by_fit.setdefault(fit, []).append(i)
        out: list[Completion] = [None] * len(asked)  # type: ignore[list-item]

        async def rows(most: int, which: list[int]) -> None:
            got = await generate([prompts[i] for i in which],
                                 replace(call, max_new_tokens=most, seed=seed + which[0]),
                                 [asked[i].session for i in which], self.agent.sticky, False)
            figures["slots"] += decode_slots([len(c.tokens) for c in got], self.max_batch)
            figures["calls"] += 1
            for i, completion in zip(which, got, strict=True):
                out[i] = completion

        await asyncio.gather(*(rows(most, which) for most, which in sorted(by_fit.items())))
        return out

    def _take(self, t: Trajectory, cap: int, new: Completion, params: SamplingParams) -> int:
        """A completion's first `cap` tokens added to its episode (a turn begun, or one
        closed: at a stop or call-closing token, the episode's room or the turn's limit, or
        a completion without tokens); returns how many."""
        reused = new.prefix.reused if new.prefix is not None else 0
        self.prefix += PrefixCounts(len(t.row.tokens) + len(t.tokens), reused,
                                    max(0, t.computed - reused))
        room, kept = self.agent.room(t), min(cap, len(new.tokens))
        if t.turn_start is None:
            t.turn_start, t.turns = len(t.tokens), t.turns + 1
        t.add(new.tokens[:kept], new.logprobs[:kept])
        t.stamp(self.version)
        # keys and values computed: the prompt so far and all but the last token sampled
        t.computed = len(t.row.tokens) + len(t.tokens) - 1
        turn = t.turn()
        if not kept or turn[-1] in (*params.stop_token_ids, *self.agent.transcript.stop_ids) \
                or kept == room or len(turn) >= self.max_new_tokens:
            self._close_turn(t, turn, kept == room, params)
        return kept

    def _close_turn(self, t: Trajectory, turn: list[int], full: bool,
                    params: SamplingParams) -> None:
        """A turn's end, as `AgentRollouts` ends one: its message, then its tool calls
        started (unless it was the last turn: they would go unread), or the episode's end."""
        transcript = self.agent.transcript
        text = transcript.decode(turn)
        parsed = transcript.parse(t, text)
        t.messages.append(parsed.as_message())
        t.said.append({"role": "assistant", "content": transcript.said_text(text)})
        t.turn_start = None
        last = turn[-1] if turn else None
        if parsed.has_calls and last not in params.stop_token_ids:
            if t.turns == self.cfg.max_turns:
                t.ended = "max_turns"
            else:
                t.pending = text
                self.under_way[t.session] = asyncio.ensure_future(
                    self.agent.tool_results(parsed))
        elif last in (*params.stop_token_ids, *transcript.stop_ids):
            t.ended = "answer"
        else:
            t.ended = "overflow" if full else "length"

    async def _read(self, t: Trajectory) -> None:
        """The results of the calls `t` waits for (made now, when they are not under way:
        after a resume) appended as its observation, counted in the step's figures."""
        parsed = self.agent.transcript.parse(t, t.pending)
        future = self.under_way.pop(t.session, None)
        if future is None:
            future = asyncio.ensure_future(self.agent.tool_results(parsed))
        results = await future
        self.agent.observe(t, parsed, t.pending, results)
        for result in results:
            self.tools.add(result)
        t.pending = None
        t.stamp(self.version)

    def take_figures(self) -> dict[str, Any]:
        """The tools' and the prefixes' figures since the last take (a step's row)."""
        figures = {**self.tools.metrics(), **prefix_metrics(self.prefix)}
        self.tools, self.prefix = ToolStats(), PrefixCounts()
        return figures

    def drop(self, groups: list[Group]) -> int:
        """Remove `groups` (their calls under way cancelled); returns how many samples went
        with them."""
        for t in (t for g in groups for t in g.samples):
            if (future := self.under_way.pop(t.session, None)) is not None:
                future.cancel()
        return super().drop(groups)

    def cancel_calls(self) -> None:
        for future in self.under_way.values():
            future.cancel()
        self.under_way = {}

    def sample_state(self, sample: Trajectory) -> dict[str, Any]:
        """An episode's state, its environment's as `EpisodeEnv.saved` has it."""
        env = sample.env.saved() if sample.env is not None else sample.env_saved
        return {**asdict(replace(sample, env=None)), "env_saved": env}

    def state_dict(self) -> dict[str, Any]:
        """The groups and the figures not taken yet (an overlapped round's)."""
        return {**super().state_dict(), "prefix": asdict(self.prefix),
                "tools": {"calls": self.tools.calls, "errors": dict(self.tools.errors),
                          "seconds": self.tools.seconds}}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Back to a checkpoint's pool (None: the start's): the calls under way dropped,
        to be made again when read."""
        self.cancel_calls()
        super().load_state_dict(state)
        state = state or {}
        self.prefix = PrefixCounts(**state.get("prefix", {}))
        tools = state.get("tools", {})
        self.tools = ToolStats(tools.get("calls", 0), Counter(tools.get("errors", {})),
                               tools.get("seconds", 0.0))

    def sample_from(self, state: dict[str, Any]) -> Trajectory:
        return Trajectory(**{**state, "row": Row(**state["row"])})


class PartialAgentRollouts(PartialRollouts):
    """Partial rollouts of multi-turn episodes with tools (see module). `agent`, the sync
    mode's episodes, runs the evaluation's and lends the pool its transcript, tools and
    limits; `generate` is the loop's `generate_turns`."""

    def __init__(self, source: Any, generate: GenerateTurns,
                 sampling: Callable[[int], SamplingParams], grpo: GRPOConfig, max_batch: int,
                 rollout: RolloutConfig, positions: int, agent: AgentRollouts) -> None:
        self.agent = agent
        super().__init__(source, generate, sampling, grpo, max_batch, rollout, positions)

    def new_pool(self) -> EpisodePool:
        return EpisodePool(self.cfg, self.grpo.group_size, self.source.max_new_tokens,
                           self.max_batch, self.agent)

    async def generate(self, index: int) -> Rollout:
        """The budget's tokens for every episode under way (step `index`'s prompts join
        unless the overlap's round drew them ahead); the finished groups' episodes."""
        if not self.pool.has(index):
            self.pool.add(self.source.sample(self.grpo.prompts_per_step), index)
        groups, metrics = await generate_step(self.pool, self.generate_ids,
                                              self.sampling(index))
        episodes = [t for g in groups for t in g.samples]
        going = [t for g in self.pool.groups for t in g.samples if not t.finished]
        metrics = {**episode_metrics(episodes), **metrics, **self.pool.take_figures(),
                   # trained episodes begun on older weights, calls under way at its end
                   "partial/episodes_carried": sum(bool(t.versions) and t.versions[0]
                                                   < self.pool.version for t in episodes),
                   "partial/calls_carried": sum(t.pending is not None for t in going)}
        if self.agent.envs is not None:
            metrics.update(env_metrics([t.env for t in episodes]))
        # a group's prompt: its first episode's (an environment's opening, or the row's)
        return Rollout([g.samples[0].row for g in groups], [t.row.tokens for t in episodes],
                       [t.completion() for t in episodes], metrics,
                       trained=[t.trained for t in episodes],
                       conversations=[t.messages if t.row.chat else None for t in episodes],
                       extra_rewards=[self.cfg.bad_call_reward if t.bad_calls else 0.0
                                      for t in episodes])

    async def episodes(self, rows: list[Row], params: SamplingParams, copies: int
                       ) -> Rollout:
        """Whole episodes (the evaluation's), as the sync mode runs them."""
        return await self.agent.episodes(rows, params, copies)

    def finish_batch(self, rollout: Rollout, batch: dict[str, torch.Tensor]
                     ) -> float | None:
        """The observations masked, then the older tokens' versions."""
        self.agent.finish_batch(rollout, batch)
        return super().finish_batch(rollout, batch)
