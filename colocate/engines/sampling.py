"""What a generator engine is asked for and what it returns, the same for every engine."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. `temperature=0` is greedy. Validated here, once."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature}: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p={self.top_p}: must be in (0, 1]")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class PrefixCounts:
    """How prompts were prefilled, for one row or summed (`total`): of `prompt_tokens`
    prefilled (a continued completion's earlier tokens included), `reused` had their keys
    and values taken from the engine's cache, not computed, and `recomputed` were computed
    again although the row's session had computed them before (its cache had let them go:
    a sleep, a weight load, eviction, or a cache too small to keep them). The rest, `new`,
    no earlier call of the session had computed."""

    prompt_tokens: int = 0
    reused: int = 0
    recomputed: int = 0

    @property
    def new(self) -> int:
        return self.prompt_tokens - self.reused - self.recomputed

    @property
    def recompute_share(self) -> float:
        """Of the tokens that could have come from the cache, the share computed again
        (0.0 when there were none)."""
        known = self.reused + self.recomputed
        return self.recomputed / known if known else 0.0

    def __add__(self, other: PrefixCounts) -> PrefixCounts:
        return PrefixCounts(self.prompt_tokens + other.prompt_tokens,
                            self.reused + other.reused, self.recomputed + other.recomputed)

    @staticmethod
    def total(counts: Iterable[PrefixCounts | None]) -> PrefixCounts:
        """The sum (None counts nothing): a call's figures from its completions'
        `prefix`."""
        return sum((c for c in counts if c is not None), PrefixCounts())


@dataclass
class Completion:
    """One sampled continuation: its tokens (a stop token included, when one ended it) and
    each token's log-probability under the sampling policy (temperature applied).

    `finished` is False for a partial one: its call was preempted (a switch needed the
    slot) before a stop token or `max_new_tokens` ended it. Pass it back to `generate`
    (`partial=`) to continue it on the weights loaded then. `versions` says, token by
    token, which weights sampled it: the generator's weights version (0 as loaded, + 1 at
    each weight load), so a continued completion tells its old tokens from its new ones
    (empty when the engine does not say). `prefix` says how the call that returned it
    prefilled its prompt (None: that call did not prefill it, a finished completion
    passed back through `partial`); `PrefixCounts.total` sums a call's."""

    tokens: list[int]
    logprobs: list[float] = field(default_factory=list)
    stopped: bool = False  # ended by a stop token, not by max_new_tokens
    finished: bool = True  # False: preempted part way, to be continued
    # per token: the weights version; provenance, not content: two completions of equal
    # tokens, log-probabilities and ends are equal whatever loads came between
    versions: list[int] = field(default_factory=list, compare=False)
    prefix: PrefixCounts | None = field(default=None, compare=False)


def partial_list(partial: Sequence[Completion | None] | None, count: int,
                   params: SamplingParams) -> list[Completion | None]:
    """A `generate` call's `partial` as a list of `count` (None: nothing before), each
    checked: one per prompt, as a generator returned it, with tokens left to sample."""
    if partial is None:
        return [None] * count
    partial = list(partial)
    if len(partial) != count:
        raise ValueError(f"partial has {len(partial)} completions for {count} prompts: give "
                         "one per prompt (None where there is nothing to continue)")
    for i, done in enumerate(partial):
        if done is None:
            continue
        if len(done.logprobs) != len(done.tokens) or done.versions and \
                len(done.versions) != len(done.tokens):
            raise ValueError(f"partial[{i}]: {len(done.tokens)} tokens but "
                             f"{len(done.logprobs)} log-probabilities and {len(done.versions)} "
                             "versions: pass back a completion as generate returned it")
        if not done.finished and len(done.tokens) >= params.max_new_tokens:
            raise ValueError(f"partial[{i}] has {len(done.tokens)} tokens already, "
                             f"max_new_tokens={params.max_new_tokens}: nothing is left to "
                             "continue (use the max_new_tokens of the call it came from)")
    return partial


def continued(before: Completion | None, new: Completion, version: int) -> Completion:
    """`new` (sampled now, on weights `version`) after what `before` had."""
    if before is None:
        return replace(new, versions=[version] * len(new.tokens))
    old_versions = before.versions or [-1] * len(before.tokens)  # -1: not known
    return Completion(before.tokens + new.tokens, before.logprobs + new.logprobs,
                      stopped=new.stopped, finished=new.finished,
                      versions=old_versions + [version] * len(new.tokens), prefix=new.prefix)
