"""How a step's rollouts are made: one interface the GRPO step calls, whatever the mode.

The step asks `generate(index)` for its scored-to-be samples while the generator is awake,
lets the rollouts start what runs beside the scoring and the training (`start_next`), asks
`finish_batch` for the batch's last touches, takes in what ran beside the
training before the trainer's weights go out (`before_sync`), and tells them once the
generator holds the new weights (`synced`). `Rollouts` is the sync mode itself (each step
generates whole groups, nothing runs beside training); `partial.PartialRollouts` carries
unfinished samples across steps and may overlap the next step's generation with training.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from colocate.engines.sampling import Completion, SamplingParams
from examples.rl_loop.data import Row
from examples.rl_loop.grpo import GRPOConfig

MODES = ("sync", "partial")
ON_STALE = ("finish", "drop")
TOOL_FORMATS = ("auto", "hermes", "template", "plain")

# the loop's `generate_ids`: a completion of each prompt (token ids), seeded by `params`
Generate = Callable[[list[list[int]], SamplingParams], Awaitable[list[Completion]]]


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
        for name in ("max_tokens_per_step", "max_staleness", "max_turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name}={getattr(self, name)}: must be >= 1")
        if not math.isfinite(self.bad_call_reward):
            raise ValueError(f"rollout.bad_call_reward={self.bad_call_reward}: must be finite")
        if not self.is_cap >= 1:
            raise ValueError(f"rollout.is_cap={self.is_cap}: must be >= 1")
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


class Rollouts:
    """Whole groups each step (`rollout.mode=sync`): `grpo.prompts_per_step` prompts from
    the source, `grpo.group_size` completions each, in one spread call."""

    def __init__(self, source: Any, generate: Generate,
                 sampling: Callable[[int], SamplingParams], grpo: GRPOConfig,
                 max_batch: int) -> None:
        self.source, self.generate_ids, self.sampling = source, generate, sampling
        self.grpo, self.max_batch = grpo, max_batch

    async def generate(self, index: int) -> Rollout:
        """Step `index`'s samples (the generator awake)."""
        rows = self.source.sample(self.grpo.prompts_per_step)
        return await self.episodes(rows, self.sampling(index), self.grpo.group_size)

    async def episodes(self, rows: list[Row], params: SamplingParams, copies: int
                       ) -> Rollout:
        """`copies` samples of each row with `params` (the generator awake)."""
        tokens = [row.tokens for row in rows for _ in range(copies)]
        completions = await self.generate_ids(tokens, params)
        lengths = [len(c.tokens) for c in completions]
        idle = 1 - sum(lengths) / max(1, decode_slots(lengths, self.max_batch))
        return Rollout(rows, tokens, completions,
                       {"finished_samples": len(completions), "gen_idle_share": idle})

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
