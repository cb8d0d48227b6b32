"""What a generator engine is asked for and what it returns, the same for every engine."""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass
class Completion:
    """One sampled continuation: its tokens (a stop token included, when one ended it) and
    each token's log-probability under the sampling policy (temperature applied).

    `finished` is False for a partial one: its call was preempted (a switch needed the
    slot) before a stop token or `max_new_tokens` ended it. Pass it back to `generate`
    (`partial=`) to continue it on the weights loaded then. `versions` says, token by
    token, which weights sampled it: the generator's weights version (0 as loaded, + 1 at
    each weight load), so a continued completion tells its old tokens from its new ones
    (empty when the engine does not say)."""

    tokens: list[int]
    logprobs: list[float] = field(default_factory=list)
    stopped: bool = False  # ended by a stop token, not by max_new_tokens
    finished: bool = True  # False: preempted part way, to be continued
    versions: list[int] = field(default_factory=list)  # per token: the weights version
