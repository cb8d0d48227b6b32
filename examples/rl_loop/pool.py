"""The carried samples of partial rollouts: each GRPO group's samples under way, their
tokens, behaviour log-probabilities and the policy version that sampled each token, and the
rounds that continue them by a token budget (`partial.py` runs the steps over them; a pool
of multi-turn episodes is `partial_episodes.EpisodePool`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from colocate.engines.sampling import Completion, SamplingParams
from examples.rl_loop.data import Row
from examples.rl_loop.rollouts import Generate, RolloutConfig, decode_slots


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

    async def advance(self, generate: Generate, params: SamplingParams,
                      groups: list[Group] | None = None, finish: bool = False
                      ) -> dict[str, int] | None:
        """One round: every unfinished sample (of `groups`, default all) continued by the
        step's budget (`finish`: up to its completion's limit) in one `generate` call with
        `params` (its seed); returns the tokens kept, the rows' decode slots and the
        generate calls made, or None when no sample is left."""
        call = self.round(groups, self.max_new_tokens if finish else None)
        if call is None:
            return None
        completions = await generate(call.prompts,
                                     replace(params, max_new_tokens=call.max_new_tokens))
        return {**self.absorb(call, completions), "calls": 1}

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
                            "samples": [self.sample_state(s) for s in g.samples]}
                           for g in self.groups]}

    def sample_state(self, sample: Sample) -> dict[str, Any]:
        """A carried sample's state, as a checkpoint keeps it (`sample_from` reads it)."""
        return asdict(sample)

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Back to a checkpoint's pool (None: the start's, empty)."""
        state = state or {"version": 0, "groups": []}
        self.version = state["version"]
        self.groups = [Group(Row(**g["row"]), g["started"],
                             [self.sample_from(s) for s in g["samples"]])
                       for g in state["groups"]]

    def sample_from(self, state: dict[str, Any]) -> Sample:
        """A carried sample back from its checkpoint's state."""
        return Sample(**state)


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
