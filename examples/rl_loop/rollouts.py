"""How a step's rollouts are made: one interface the GRPO step calls, whatever the mode.

The step asks `generate(index)` for its scored-to-be samples while the generator is awake,
lets the rollouts start what runs beside the scoring and the training (`start_next`), asks
`finish_batch` for the batch's last touches, takes in what ran beside the
training before the trainer's weights go out (`before_sync`), and tells them once the
generator holds the new weights (`synced`). `Rollouts` is the sync mode itself (each step
generates whole groups, nothing runs beside training); `partial.PartialRollouts` carries
unfinished samples across steps and may overlap the next step's generation with training.
With `grpo.dynamic_sampling` (sync mode only), a step's groups are scored as they are made
and those without a learning signal replaced by new ones (`Rollouts.dynamic`).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from colocate.engines.sampling import Completion, SamplingParams
from examples.rl_loop.data import Row
from examples.rl_loop.grpo import GRPOConfig
from examples.rl_loop.sources import Scored

MODES = ("sync", "partial")
ON_STALE = ("finish", "drop")
TOOL_FORMATS = ("auto", "hermes", "template", "plain")

# the loop's `generate_ids`: a completion of each prompt (token ids), seeded by `params`
Generate = Callable[[list[list[int]], SamplingParams], Awaitable[list[Completion]]]
ROUND_SEED = 32_452_843  # dynamic sampling: round r of a step samples with its seed + r x this


@dataclass(frozen=True)
class RolloutConfig:
    """How a step's rollouts are made."""

    mode: str = "sync"  # sync: each step generates whole groups; partial: a token budget
    max_tokens_per_step: int = 8  # partial: new tokens a sample may get in one step
    max_staleness: int = 4  # partial: policy versions a sample may span (its tokens' range)
    on_stale: str = "finish"  # partial, past max_staleness: finish it now, or drop its group
    is_cap: float = 2.0  # partial: the truncation C of the importance weight of older tokens
    overlap: bool = False  # partial: the next step's first round generated while one trains
    max_turns: int = 4  # tools: the model's turns in an episode at most
    max_trajectory_tokens: int = 0  # tools: an episode's tokens after its prompt (0: the
    # model's positions); past it the episode ends, counted as an overflow
    tool_format: str = "auto"  # tools: how calls are written: auto (hermes where the
    # tokenizer has a chat template, else plain), hermes, template, plain
    bad_call_reward: float = 0.0  # tools: the reward of an episode with a call that won't parse
    cohorts: int = 1  # tools/env, sync: a step's episodes in this many cohorts, each turn by
    # turn; one decodes while another waits for its tools (1: all in lockstep)
    continuous: bool = False  # tools/env, sync: each episode on its own, a call a turn
    # joining the generator's running batch (continuous batching; cohorts=1; vLLM:
    # one-rank replicas)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"rollout.mode={self.mode!r}: use one of {MODES}")
        if self.on_stale not in ON_STALE:
            raise ValueError(f"rollout.on_stale={self.on_stale!r}: use one of {ON_STALE}")
        if self.tool_format not in TOOL_FORMATS:
            raise ValueError(f"rollout.tool_format={self.tool_format!r}: use one of "
                             f"{TOOL_FORMATS}")
        if self.max_trajectory_tokens < 0:
            raise ValueError(f"rollout.max_trajectory_tokens={self.max_trajectory_tokens}: "
                             "must be >= 0 (0: the model's positions)")
        for name in ("max_tokens_per_step", "max_staleness", "max_turns", "cohorts"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name}={getattr(self, name)}: must be >= 1")
        if not math.isfinite(self.bad_call_reward):
            raise ValueError(f"rollout.bad_call_reward={self.bad_call_reward}: must be finite")
        if not self.is_cap >= 1:
            raise ValueError(f"rollout.is_cap={self.is_cap}: must be >= 1")
        if self.cohorts > 1 and self.partial:
            raise ValueError(f"rollout.cohorts={self.cohorts} with rollout.mode=partial: a "
                             "partial round runs every episode's turns together; use "
                             "rollout.cohorts=1 there")
        if self.continuous and (self.cohorts > 1 or self.partial):
            raise ValueError("rollout.continuous=true runs each episode on its own (its "
                             "calls join the generator's running batch): it takes "
                             "rollout.cohorts=1 and rollout.mode=sync")
        if self.overlap and not self.partial:
            raise ValueError("rollout.overlap=true continues carried samples while a step "
                             "trains: it needs rollout.mode=partial")

    @property
    def partial(self) -> bool:
        return self.mode == "partial"


@dataclass
class Rollout:
    """A step's samples to score and train on: one prompt row per GRPO group, each sample's
    prompt tokens and completion, and the step's generation figures."""

    rows: list[Row]
    tokens: list[list[int]]
    completions: list[Completion]
    metrics: dict[str, Any]
    # multi-turn episodes (`episodes.py`): which completion tokens the model wrote, each
    # sample's messages after a chat prompt (None: a text row's), a reward added to each
    trained: list[list[bool]] | None = None
    conversations: list[list[dict[str, Any]] | None] | None = None
    extra_rewards: list[float] | None = None
    episodes: list[Any] | None = None  # multi-turn: each sample's `episodes.Episode`
    scored: Scored | None = None  # its rewards, where the rollouts scored it (dynamic sampling)


# the loop's scoring of a step's rollout (`Loop._score`, group_size samples a row): the
# place named in its errors, and the rollout
Score = Callable[[str, Rollout], Awaitable[Scored]]


class Rollouts:
    """Whole groups each step (`rollout.mode=sync`): `grpo.prompts_per_step` prompts from
    the source, `grpo.group_size` completions each, in one spread call. `score` is the
    loop's scoring, which dynamic sampling needs (None: the loop scores every step)."""

    def __init__(self, source: Any, generate: Generate,
                 sampling: Callable[[int], SamplingParams], grpo: GRPOConfig,
                 max_batch: int, score: Score | None = None) -> None:
        self.source, self.generate_ids, self.sampling = source, generate, sampling
        self.grpo, self.max_batch, self.score = grpo, max_batch, score

    async def generate(self, index: int) -> Rollout:
        """Step `index`'s samples (the generator awake); with `grpo.dynamic_sampling`,
        scored, only groups with a learning signal (`dynamic`)."""
        if self.grpo.dynamic_sampling:
            return await self.dynamic(index)
        rows = self.source.sample(self.grpo.prompts_per_step)
        return await self.episodes(rows, self.sampling(index), self.grpo.group_size)

    async def dynamic(self, index: int) -> Rollout:
        """Step `index`'s samples by DAPO's dynamic sampling: rounds of prompts_per_step
        prompts, each generated and scored here, the groups whose rewards are all equal
        dropped, until prompts_per_step groups are left or grpo.max_gen_batches rounds are
        done (`refill` says which groups the batch takes, and when none had a signal).

        The rollout comes scored (`Rollout.scored`, which the loop takes as it is). The
        scoring runs while the generator is awake, so the step's generate_s includes it
        and the trainer's wake starts after the last round. Its figures: the generation's
        over every round (`merged_metrics`: finished_samples counts every sample made),
        the samples' over those kept, `Refill.metrics`' counts, and
        `dynamic/reward_all_samples`, the mean reward of every sample generated (the
        step's `reward` stays that of the batch trained on); the reward functions' own
        (`rewards/*`, samples_dropped...) cover every sample generated (`pooled`).

        Each round draws its prompts on from the source, as a step does, and the next
        step's come after them: the source's position is what a checkpoint keeps, so the
        same seed gives the same run, a resumed one included (and a data file's epoch
        still shows each row once). Round r samples with the step's seed + r x
        ROUND_SEED."""
        if self.score is None:
            raise ValueError("grpo.dynamic_sampling=true: these rollouts were built without "
                             "the loop's score function")
        params, size = self.sampling(index), self.grpo.group_size
        rounds: list[Rollout] = []

        async def draw(r: int) -> list[float | None]:
            rows = self.source.sample(self.grpo.prompts_per_step)
            seed = None if params.seed is None else params.seed + ROUND_SEED * r
            rollout = await self.episodes(rows, replace(params, seed=seed), size)
            rollout.scored = await self.score(
                f"step {index}" + (f", round {r + 1}" if r else ""), rollout)
            rounds.append(rollout)
            return rollout.scored.values

        plan = await refill(draw, self.grpo.prompts_per_step, size, self.grpo.max_gen_batches)
        batch = pick(rounds, plan.groups, size)
        every = [v for r in rounds for v in r.scored.values if v is not None]
        batch.metrics = {**self.merged_metrics(rounds, batch), **plan.metrics(),
                         "dynamic/reward_all_samples": sum(every) / len(every) if every
                         else None}
        return batch

    def merged_metrics(self, rounds: list[Rollout], kept: Rollout) -> dict[str, Any]:
        """A dynamically sampled step's generation figures: over every round's calls."""
        return generation_metrics([[len(c.tokens) for c in r.completions] for r in rounds],
                                  self.max_batch)

    async def episodes(self, rows: list[Row], params: SamplingParams, copies: int
                       ) -> Rollout:
        """`copies` samples of each row with `params` (the generator awake)."""
        tokens = [row.tokens for row in rows for _ in range(copies)]
        completions = await self.generate_ids(tokens, params)
        lengths = [len(c.tokens) for c in completions]
        return Rollout(rows, tokens, completions,
                       generation_metrics([lengths], self.max_batch))

    async def start_next(self, index: int, generate: Generate, side_by_side: bool) -> None:
        """Start what runs beside this step's scoring and training, for step `index`:
        `generate` takes the generator's turn; `side_by_side`, whether its slots hold the
        generator awake beside the trainer. Nothing, in sync mode."""

    def finish_batch(self, rollout: Rollout, batch: dict[str, torch.Tensor]
                     ) -> float | None:
        """The batch's last touches (what its mask leaves out, its tokens' versions); returns
        the truncation of the importance weight its loss needs (None: none, every token the
        trainer's own version's)."""
        return None

    async def before_sync(self) -> dict[str, Any]:
        """Take in what ran beside the training (before the weights change); its figures."""
        return {}

    def synced(self) -> None:
        """The generator holds the trainer's new weights."""

    def drop(self) -> None:
        """The step failed: end what runs beside it."""

    def state_dict(self) -> dict[str, Any] | None:
        """What a checkpoint keeps of the rollouts under way (None: nothing carried)."""
        return None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Back to a checkpoint's rollouts under way (None: the start's)."""


def decode_slots(lengths: list[int], max_batch: int) -> int:
    """Row-steps a generate call decoded: each batch of `max_batch` rows (the torch
    generator's) runs until its longest row ends (the idle share is 1 - tokens / slots)."""
    return sum(len(chunk) * max(chunk, default=0)
               for chunk in (lengths[i:i + max_batch] for i in range(0, len(lengths), max_batch)))


def generation_metrics(calls: list[list[int]], max_batch: int) -> dict[str, Any]:
    """Generate calls' figures, from each call's completion lengths: the samples finished,
    and the share of the decoded row-steps that made no token (`decode_slots`)."""
    slots = sum(decode_slots(lengths, max_batch) for lengths in calls)
    return {"finished_samples": sum(len(lengths) for lengths in calls),
            "gen_idle_share": 1 - sum(sum(lengths) for lengths in calls) / max(1, slots)}


def signal_groups(values: list[float | None], group_size: int) -> list[bool]:
    """For each group (`group_size` contiguous samples of one prompt), whether it has a
    learning signal: two different rewards at least among its scored samples (None: no
    reward). The others get advantage 0 on every sample (`grpo.group_advantages`)."""
    return [len({v for v in values[start:start + group_size] if v is not None}) > 1
            for start in range(0, len(values), group_size)]


@dataclass
class Refill:
    """Which groups a dynamically sampled step trains on, and what finding them took."""

    groups: list[tuple[int, int]]  # (round, group within its round), in the batch's order
    rounds: int  # rounds generated
    kept: int  # groups with a signal in the batch
    dropped: int  # groups whose rewards were all equal, in every round
    trimmed: int  # groups with a signal past prompts_per_step, left out

    def metrics(self) -> dict[str, int]:
        """The step's row's `dynamic/*` counts."""
        return {"dynamic/gen_batches": self.rounds, "dynamic/groups_kept": self.kept,
                "dynamic/groups_dropped": self.dropped,
                "dynamic/groups_trimmed": self.trimmed}


async def refill(draw: Callable[[int], Awaitable[list[float | None]]], wanted: int,
                 group_size: int, max_rounds: int) -> Refill:
    """Dynamic sampling's choice of groups: `draw(r)` generates and scores round r and
    gives its samples' rewards, group after group; rounds go on until `wanted` groups with
    a signal (`signal_groups`) are found or `max_rounds` are done. The batch is the first
    `wanted` of them, in order; after the last round, those there are, if fewer; if none,
    the last round's groups as they are: a batch without a policy gradient (advantages
    all 0) rather than a step without a batch, so the step and its figures still come."""
    found: list[tuple[int, int]] = []
    dropped = rounds = 0
    while rounds < max_rounds and len(found) < wanted:
        signal = signal_groups(await draw(rounds), group_size)
        found += [(rounds, group) for group, has in enumerate(signal) if has]
        dropped += signal.count(False)
        rounds += 1
    if not found:
        return Refill([(rounds - 1, group) for group in range(len(signal))], rounds, 0,
                      dropped, 0)
    return Refill(found[:wanted], rounds, min(wanted, len(found)), dropped,
                  max(0, len(found) - wanted))


SAMPLE_FIELDS = ("tokens", "completions", "trained", "conversations", "extra_rewards",
                 "episodes")  # a Rollout's lists of one entry per sample


def pick(rounds: list[Rollout], groups: list[tuple[int, int]], group_size: int) -> Rollout:
    """The rollout of `groups` ((round, group) pairs, in this order) from the rounds'
    scored rollouts: each group's row, its samples with all that goes with each (prompt
    tokens, completions and their behaviour log-probs, trained masks, conversations,
    added rewards, episodes) and their rewards; the reward functions' figures over every
    round's samples (`pooled`). Its own figures are the caller's to give."""
    samples = [(r, g * group_size + i) for r, g in groups for i in range(group_size)]

    def taken(name: str) -> list[Any] | None:
        if getattr(rounds[0], name) is None:
            return None
        return [getattr(rounds[r], name)[i] for r, i in samples]

    dropped = {(r, i) for r, rollout in enumerate(rounds) for i in rollout.scored.dropped}
    scored = Scored([rounds[r].scored.values[i] for r, i in samples],
                    [n for n, sample in enumerate(samples) if sample in dropped],
                    pooled([(r.scored.metrics, len(r.scored.values)) for r in rounds]))
    return Rollout([rounds[r].rows[g] for r, g in groups], metrics={}, scored=scored,
                   **{name: taken(name) for name in SAMPLE_FIELDS})


def pooled(parts: list[tuple[dict[str, Any], int]]) -> dict[str, Any]:
    """Several rounds' reward figures (`Scored.metrics`, with each round's sample count) as
    one: each `<name>/mean` and `<name>/std` pooled over the rounds (each weighed by its
    samples: exact where a function scored every sample), the other figures (counts)
    summed."""
    out: dict[str, Any] = {}
    for key in dict.fromkeys(key for metrics, _ in parts for key in metrics):
        if key.endswith("/mean"):
            std = key.removesuffix("/mean") + "/std"
            out[key], out[std] = pooled_mean_std(
                [(n, m[key], m.get(std) or 0.0) for m, n in parts if m.get(key) is not None])
        elif not key.endswith("/std"):
            out[key] = sum(m.get(key, 0) for m, _ in parts)
    return out


def pooled_mean_std(parts: list[tuple[int, float, float]]) -> tuple[float | None,
                                                                    float | None]:
    """The mean and unbiased std of the union of samples given as (count, mean, unbiased
    std) parts; (None, None) without samples."""
    total = sum(n for n, _, _ in parts)
    if not total:
        return None, None
    mean = sum(n * m for n, m, _ in parts) / total
    squares = sum((n - 1) * s**2 + n * (m - mean) ** 2 for n, m, s in parts)
    return mean, math.sqrt(squares / (total - 1)) if total > 1 else 0.0
