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
the scoring and the training; the loop takes its tokens in before its checkpoint and the
sync (`Prefetch.absorb`). The round has the token budget too, so it ends by itself and the
run repeats; on slots with room for both (`run.slot_memory`) the two run side by side,
otherwise the switches take them in turn. The next step then starts with that round done.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from colocate.engines.sampling import Completion
from examples.rl_loop.data import Row

MODES = ("sync", "partial")
ON_STALE = ("finish", "drop")


@dataclass(frozen=True)
class RolloutConfig:
    """How a step's rollouts are made."""

    mode: str = "sync"  # sync: each step generates whole groups; partial: a token budget
    max_tokens_per_step: int = 8  # partial: new tokens a sample may get in one step
    max_staleness: int = 4  # partial: policy versions a sample may span (its tokens' range)
    on_stale: str = "finish"  # partial, past max_staleness: finish it now, or drop its group
    is_cap: float = 2.0  # partial: the truncation C of the importance weight of older tokens
    overlap: bool = False  # partial: the next step's first round generated while one trains

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"rollout.mode={self.mode!r}: use one of {MODES}")
        if self.on_stale not in ON_STALE:
            raise ValueError(f"rollout.on_stale={self.on_stale!r}: use one of {ON_STALE}")
        for name in ("max_tokens_per_step", "max_staleness"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name}={getattr(self, name)}: must be >= 1")
        if not self.is_cap >= 1:
            raise ValueError(f"rollout.is_cap={self.is_cap}: must be >= 1")
        if self.overlap and not self.partial:
            raise ValueError("rollout.overlap=true continues carried samples while a step "
                             "trains: it needs rollout.mode=partial")

    @property
    def partial(self) -> bool:
        return self.mode == "partial"


@dataclass
class Sample:
    """One completion under way: its tokens, their behaviour log-probabilities and the
    policy version that sampled each."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    stopped: bool = False
    finished: bool = False

    def completion(self) -> Completion:
        return Completion(list(self.tokens), list(self.logprobs), stopped=self.stopped,
                          finished=self.finished, versions=list(self.versions))


@dataclass
class Group:
    """One prompt's GRPO group, started at step `started`."""

    row: Row
    started: int
    samples: list[Sample]

    @property
    def done(self) -> bool:
        return all(s.finished for s in self.samples)

    def oldest(self, version: int) -> int:
        """The oldest version among its tokens (`version`, the current, when it has none)."""
        return min((s.versions[0] for s in self.samples if s.versions), default=version)


@dataclass
class Round:
    """One generate call of a step: the prompts to send, which samples they continue and
    how many new tokens each may keep."""

    prompts: list[list[int]]
    targets: list[tuple[Group, Sample]]
    max_new_tokens: int  # asked of the call
    room: list[int]  # tokens each row may keep (its completion's limit minus what it has)


class Pool:
    """The carried groups of a partial run, oldest first, and the policy version (training
    steps done)."""

    def __init__(self, cfg: RolloutConfig, group_size: int, max_new_tokens: int,
                 max_batch: int = 64) -> None:
        self.cfg, self.group_size, self.max_new_tokens = cfg, group_size, max_new_tokens
        self.max_batch = max_batch  # the generator's: rows decoded together
        self.groups: list[Group] = []
        self.version = 0

    def has(self, step: int) -> bool:
        """Whether the groups of step `step` are in (added ahead by `prefetch`)."""
        return any(g.started == step for g in self.groups)

    def add(self, rows: list[Row], step: int) -> None:
        self.groups += [Group(row, step, [Sample() for _ in range(self.group_size)])
                        for row in rows]

    def round(self, groups: list[Group] | None = None, budget: int | None = None
              ) -> Round | None:
        """The call that continues every unfinished sample (of `groups`, default all) by
        up to `budget` tokens (default the step's budget); None when none is left."""
        budget = budget or self.cfg.max_tokens_per_step
        targets = [(g, s) for g in (self.groups if groups is None else groups)
                   for s in g.samples if not s.finished]
        if not targets:
            return None
        room = [min(budget, self.max_new_tokens - len(s.tokens)) for _, s in targets]
        return Round([g.row.tokens + s.tokens for g, s in targets], targets, max(room), room)

    def absorb(self, call: Round, completions: list[Completion]) -> dict[str, int]:
        """The call's completions added to their samples (cut to each row's room); returns
        the tokens kept and the rows' decode slots (for the idle share)."""
        kept = 0
        for (_, sample), room, new in zip(call.targets, call.room, completions, strict=True):
            cut = min(room, len(new.tokens))
            sample.tokens += new.tokens[:cut]
            sample.logprobs += new.logprobs[:cut]
            sample.versions += [self.version] * cut
            sample.stopped = new.stopped and cut == len(new.tokens)
            sample.finished = sample.stopped or len(sample.tokens) >= self.max_new_tokens
            kept += cut
        return {"tokens": kept, "slots": decode_slots([len(c.tokens) for c in completions],
                                                        self.max_batch)}

    def overdue(self) -> list[Group]:
        """Unfinished groups that the next step's tokens would make span more than
        max_staleness versions."""
        return [g for g in self.groups if not g.done
                and self.version + 1 - g.oldest(self.version) > self.cfg.max_staleness]

    def drop(self, groups: list[Group]) -> int:
        """Remove `groups`; returns how many samples went with them."""
        gone = {id(g) for g in groups}
        self.groups = [g for g in self.groups if id(g) not in gone]
        return len(groups) * self.group_size

    def take_done(self) -> list[Group]:
        """The finished groups, removed from the pool, in the order they were started."""
        done = [g for g in self.groups if g.done]
        self.groups = [g for g in self.groups if not g.done]
        return done

    def carried(self) -> dict[str, int]:
        samples = [s for g in self.groups for s in g.samples if not s.finished]
        return {"carried_samples": len(samples),
                "carried_tokens": sum(len(s.tokens) for s in samples),
                "carried_groups": len(self.groups)}

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version,
                "groups": [{"row": asdict(g.row), "started": g.started,
                            "samples": [asdict(s) for s in g.samples]} for g in self.groups]}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Back to a checkpoint's pool (None: the start's, empty)."""
        state = state or {"version": 0, "groups": []}
        self.version = state["version"]
        self.groups = [Group(Row(**g["row"]), g["started"], [Sample(**s) for s in g["samples"]])
                       for g in state["groups"]]


def decode_slots(lengths: list[int], max_batch: int) -> int:
    """Row-steps a generate call decoded: each batch of `max_batch` rows (the torch
    generator's) runs until its longest row ends (the idle share is 1 - tokens / slots)."""
    return sum(len(chunk) * max(chunk, default=0)
               for chunk in (lengths[i:i + max_batch] for i in range(0, len(lengths), max_batch)))


def staleness(groups: list[Group], version: int) -> dict[str, Any]:
    """The trained samples' spans (versions between their first and last token) as a
    histogram, and the share of tokens sampled by an older version than `version`."""
    samples = [s for g in groups for s in g.samples]
    spans = [s.versions[-1] - s.versions[0] if s.versions else 0 for s in samples]
    tokens = sum(len(s.versions) for s in samples)
    older = sum(v < version for s in samples for v in s.versions)
    hist: dict[str, int] = {}
    for span in sorted(spans):
        hist[str(span)] = hist.get(str(span), 0) + 1
    return {"staleness_hist": hist, "staleness_max": max(spans, default=0),
            "staleness_mean": sum(spans) / len(spans) if spans else 0.0,
            "stale_token_share": older / tokens if tokens else 0.0}


async def generate_step(pool: Pool, generate: Any, sampling: Any) -> tuple[list[Group],
                                                                          dict[str, Any]]:
    """A partial step's generation (the generator awake): every unfinished sample continued
    by the budget's tokens, in one call (more, on the same weights, until some group is
    finished, so that every step trains); the groups past max_staleness finished now or
    dropped. Returns the finished groups, taken from the pool, and the step's figures.
    `generate(prompts, params)` is the loop's (`Runtime.generate_ids`); `sampling` has the
    step's seed."""
    kept = slots = calls = dropped = 0

    async def run(call: Round) -> None:
        nonlocal kept, slots, calls
        params = replace(sampling, max_new_tokens=call.max_new_tokens,
                         seed=sampling.seed + 7919 * calls)
        absorbed = pool.absorb(call, await generate(call.prompts, params))
        kept, slots, calls = kept + absorbed["tokens"], slots + absorbed["slots"], calls + 1

    while not any(g.done for g in pool.groups):
        call = pool.round()
        if call is None:
            break
        await run(call)
    overdue = pool.overdue()
    if overdue and pool.cfg.on_stale == "finish":
        call = pool.round(overdue, budget=pool.max_new_tokens)
        if call is not None:
            await run(call)
    elif overdue:
        dropped = pool.drop(overdue)
    done = pool.take_done()
    return done, {"generate_calls": calls, "generated_tokens": kept,
                  "gen_idle_share": 1 - kept / slots if slots else 0.0,
                  "finished_samples": len(done) * pool.group_size,
                  "dropped_stale_samples": dropped, **pool.carried(),
                  **staleness(done, pool.version)}


PREFETCH_SEED = 104_729  # a prefetch round's seed: its step's, plus this (apart from its calls')


@dataclass
class Prefetch:
    """A round under way while a step trains (`rollout.overlap`)."""

    pool: Pool
    call: Round
    task: asyncio.Future

    async def absorb(self) -> dict[str, int]:
        """Wait for the round and add its tokens to the pool, as of the version that
        sampled them (before the step's weights go to the generator)."""
        return self.pool.absorb(self.call, await self.task)


def prefetch(pool: Pool, rows: list[Row], step: int,
             generate: Callable[[list[list[int]], Any], Awaitable[list[Completion]]],
             sampling: Any) -> Prefetch | None:
    """Add step `step`'s prompts (`rows`) to the pool and start the round that continues
    every unfinished sample by the token budget; `sampling` has step `step`'s seed."""
    pool.add(rows, step)
    call = pool.round()
    if call is None:
        return None
    params = replace(sampling, max_new_tokens=call.max_new_tokens,
                     seed=sampling.seed + PREFETCH_SEED)
    return Prefetch(pool, call, asyncio.ensure_future(generate(call.prompts, params)))


def check_room(longest_prompt: int, max_new_tokens: int, budget: int, model_dir: Any) -> None:
    """A continued sample's prompt is the prompt and its tokens so far, and its call asks
    for up to the budget's tokens more: the model's positions must hold that much."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    limit = config.get("max_position_embeddings")
    need = longest_prompt + max_new_tokens - 1 + budget
    if limit is not None and need > limit:
        raise ValueError(
            f"rollout.mode=partial: the longest prompt ({longest_prompt} tokens), a sample "
            f"one token short of its {max_new_tokens} and a call of "
            f"rollout.max_tokens_per_step={budget} need {need} positions; the model has "
            f"{limit}: raise model.max_positions (the tiny model) or lower the budget")
