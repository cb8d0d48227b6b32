"""Partial rollouts (`rollout.mode=partial`): each step's generation has a budget, the GRPO
groups whose completions are all finished are trained, and the unfinished samples carry
over to the next step, to be continued on the newer weights.

The budget is a token budget, `rollout.max_tokens_per_step`: in a step every unfinished
sample gets at most that many new tokens (decoding steps), after which the step goes on to
its training. It is met without a preemption signal: the step's one `generate` call asks
for that many new tokens per row, each carried sample's prompt extended by its tokens so
far, so the call ends by itself after that many decoding steps and every row is continued
by one batched call. That is what the generator's own continuation does (`generate(...,
partial=)`: the prompt and the tokens so far prefilled on the weights loaded now, as vLLM's
recompute preemption), but `partial=` gives each row `max_new_tokens - len(prefix)` new
tokens, so rows carried for different numbers of steps would need a call each. The
runtime's preemption (`phase(trainer, preempt=True)`) stops a generation when a switch
asks, at a moment, not at a token count: a run budgeted by it does not repeat, while a token
budget makes the same seed give the same run, a resumed one included. (A time budget would
be the place for it; not built yet.)

Each token keeps the behaviour log-probability of the policy version that sampled it and
that version (`Sample.versions`: the number of training steps behind the weights, not the
generator's own load counter, which a respawn or a resume restarts). A group lives at most
`rollout.max_staleness` versions: one whose next continuation would span more is finished
within this step (`rollout.on_stale=finish`: no bias against the long samples) or dropped
(`drop`). The carried groups are part of the loop's state (`state_dict`, in loop.json).
How the loss corrects for the older tokens: `grpo.grpo_loss`'s `prox_logprobs`.

With `rollout.overlap`, the generation goes on while the step trains, as veRL's colocated
async trainer keeps its rollout engine busy on the shared pool until the weight update:
once a step has taken its finished groups, the next step's prompts join the pool and one
round continues every unfinished sample (`prefetch`), on the weights of this step, beside
the scoring and the training; the loop waits for it before its checkpoint and the sync
(`PartialRollouts.before_sync`), its tokens in as of the version that sampled them. The
round has the token budget too, so it ends by itself and the run repeats. On roomy slots
(both tenants and their working memory fit) the two run side by side; otherwise the round
runs first, to its end, before the trainer's wake, which would otherwise throw out what the
round's wake brought in (`PartialRollouts.start_next`). The next step then starts with that
round done.

Multi-turn episodes with tools (`tools.funcs`) are items of the pool as well:
`partial_episodes.py`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from colocate.engines.sampling import SamplingParams
from examples.rl_loop.batch import behind
from examples.rl_loop.data import Row
from examples.rl_loop.grpo import GRPOConfig
from examples.rl_loop.pool import Group, Pool, staleness
from examples.rl_loop.rollouts import Generate, Rollout, RolloutConfig, Rollouts


async def generate_step(pool: Pool, generate: Any, sampling: Any) -> tuple[list[Group],
                                                                          dict[str, Any]]:
    """A partial step's generation (the generator awake): every unfinished sample continued
    by the budget's tokens, in one round (more, on the same weights, until some group is
    finished, so that every step trains); the groups past max_staleness finished now or
    dropped. Returns the finished groups, taken from the pool, and the step's figures.
    `generate` is the loop's (`Runtime.generate_ids`, or `generate_turns` for a pool of
    episodes); `sampling` has the step's seed."""
    kept = slots = calls = rounds = dropped = 0

    async def run(groups: list[Group] | None = None, finish: bool = False) -> bool:
        nonlocal kept, slots, calls, rounds
        params = replace(sampling, seed=sampling.seed + 7919 * rounds)
        absorbed = await pool.advance(generate, params, groups, finish)
        if absorbed is None:
            return False
        kept, slots = kept + absorbed["tokens"], slots + absorbed["slots"]
        calls, rounds = calls + absorbed["calls"], rounds + 1
        return True

    while not any(g.done for g in pool.groups) and await run():
        pass
    overdue = pool.overdue()
    if overdue and pool.cfg.on_stale == "finish":
        await run(overdue, finish=True)
    elif overdue:
        dropped = pool.drop(overdue)
    done = pool.take_done()
    return done, {"generate_calls": calls, "generated_tokens": kept,
                  "gen_idle_share": 1 - kept / slots if slots else 0.0,
                  "finished_samples": len(done) * pool.group_size,
                  "dropped_stale_samples": dropped, **pool.carried(),
                  **staleness(done, pool.version)}


PREFETCH_SEED = 104_729  # a prefetch round's seed: its step's, plus this (apart from its calls')


def prefetch(pool: Pool, rows: list[Row], step: int, generate: Any,
             sampling: SamplingParams) -> asyncio.Future:
    """Add step `step`'s prompts (`rows`) to the pool and start the round that continues
    every unfinished sample by the token budget (its tokens go in as of the version that
    sampled them, before the step's weights go to the generator); `sampling` has step
    `step`'s seed. The future gives the round's figures (`Pool.advance`)."""
    pool.add(rows, step)
    return asyncio.ensure_future(
        pool.advance(generate, replace(sampling, seed=sampling.seed + PREFETCH_SEED)))


def check_room(longest_prompt: int, max_new_tokens: int, budget: int, positions: int) -> None:
    """A continued sample's prompt is the prompt and its tokens so far, and its call asks
    for up to the budget's tokens more: the run's `positions` (the model's, or fewer that
    the generator serves) must hold that much."""
    need = longest_prompt + max_new_tokens - 1 + budget
    if need > positions:
        raise ValueError(
            f"rollout.mode=partial: the longest prompt ({longest_prompt} tokens), a sample "
            f"one token short of its {max_new_tokens} and a call of "
            f"rollout.max_tokens_per_step={budget} need {need} positions; the run has "
            f"{positions}: raise model.max_positions (the tiny model) or "
            "generator.max_model_len, or lower the budget")


class PartialRollouts(Rollouts):
    """The partial mode (see module): the pool of carried groups, which owns the policy
    version of their tokens, and with `rollout.overlap` the next step's first round."""

    def __init__(self, source: Any, generate: Generate,
                 sampling: Callable[[int], SamplingParams], grpo: GRPOConfig, max_batch: int,
                 rollout: RolloutConfig, positions: int) -> None:
        super().__init__(source, generate, sampling, grpo, max_batch)
        self.cfg = rollout
        check_room(source.longest_prompt(), source.max_new_tokens,
                   rollout.max_tokens_per_step, positions)
        self.pool = self.new_pool()
        self.prefetched: asyncio.Future | None = None  # the round beside the training
        self.beside: dict[str, Any] = {}  # its figures, for the step's row

    def new_pool(self) -> Pool:
        """The pool of carried samples, empty."""
        return Pool(self.cfg, self.grpo.group_size, self.source.max_new_tokens,
                    self.max_batch)

    async def generate(self, index: int) -> Rollout:
        """The budget's tokens for every sample under way (step `index`'s prompts join
        unless the overlap's round drew them ahead); the finished groups."""
        if not self.pool.has(index):
            self.pool.add(self.source.sample(self.grpo.prompts_per_step), index)
        groups, metrics = await generate_step(self.pool, self.generate_ids,
                                              self.sampling(index))
        return Rollout([g.row for g in groups],
                       [g.row.tokens for g in groups for _ in g.samples],
                       [s.completion() for g in groups for s in g.samples], metrics)

    async def start_next(self, index: int, generate: Generate, side_by_side: bool) -> None:
        """With `rollout.overlap`: step `index`'s prompts join and its first round starts.
        Where the slots cannot hold the generator beside the trainer (`side_by_side`
        false), the round runs first, to its end, before the trainer's wake: a wake beside
        it would throw out what the other brought in."""
        self.beside = {}
        if not self.cfg.overlap:
            return
        self.prefetched = prefetch(self.pool, self.source.sample(self.grpo.prompts_per_step),
                                   index, generate, self.sampling(index))
        self.beside["overlap_side_by_side"] = int(side_by_side)
        if not side_by_side:
            await self._absorb()

    async def _absorb(self) -> None:
        if self.prefetched is not None:
            prefetched, self.prefetched = self.prefetched, None
            if (absorbed := await prefetched) is not None:
                self.beside["prefetched_tokens"] = absorbed["tokens"]

    def finish_batch(self, rollout: Rollout, batch: dict[str, torch.Tensor]
                     ) -> float | None:
        batch["behind"] = behind(rollout.tokens, rollout.completions, self.pool.version,
                                 batch["mask"])
        return self.cfg.is_cap if bool(batch["behind"].any()) else None

    async def before_sync(self) -> dict[str, Any]:
        """The round's tokens in, as of the version that sampled them."""
        await self._absorb()
        return self.beside

    def synced(self) -> None:
        self.pool.version += 1  # the generator's weights: one training step newer

    def drop(self) -> None:
        if self.prefetched is not None:
            self.prefetched.cancel()
            self.prefetched.add_done_callback(
                lambda done: done.cancelled() or done.exception())
            self.prefetched = None

    def state_dict(self) -> dict[str, Any]:
        return self.pool.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.prefetched = None
        self.pool.load_state_dict(state)
