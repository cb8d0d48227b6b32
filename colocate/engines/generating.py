"""What a generator engine is (`Generator`: the torch one and vLLM's), and the check both
make before generating (`check_prompts`). `GeneratorActor` holds one; the weight syncs and
the arbiter reach it through these calls and its `tenancy` only. Sessions (a trajectory's
turns, `sessions=` per row) and their prefix counts are the same on both engines
(`colocate.engines.sessions`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Protocol

import torch

from colocate.arbiter.tenant import Tenancy
from colocate.engines.sampling import Completion, PrefixCounts, SamplingParams
from colocate.engines.weights import WeightStream


class Generator(Protocol):
    """A generator engine: its stages (`tenancy`: sleep, wake, describe), new weights in
    place, its weights out, and generation (partial, stoppable when `preemptible`; whole
    calls, or calls joining a running batch)."""

    @property
    def tenancy(self) -> Tenancy: ...

    @property
    def preemptible(self) -> bool:
        """Whether a running `generate` stops when its `stop` answers True."""
        ...

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 partial: Sequence[Completion | None] | None = None,
                 stop: Callable[[], bool] | None = None,
                 sessions: Sequence[str | None] | None = None) -> list[Completion]: ...

    def submit(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
               partial: Sequence[Completion | None] | None = None,
               stop: Callable[[], bool] | None = None,
               sessions: Sequence[str | None] | None = None) -> Future[list[Completion]]:
        """What `generate` returns, by continuous batching: the rows join the running batch
        of the calls submitted before, and the future's result comes once they ended."""
        ...

    def end_session(self, session: str) -> None:
        """Forget `session` (what is cached for it goes)."""
        ...

    def prefix_counts(self, reset: bool = False) -> PrefixCounts:
        """Every generated row's prefix counts summed (`reset`: then from zero again)."""
        ...

    def load_weights(self, weights: WeightStream | Iterable[tuple[str, torch.Tensor]]
                     ) -> int: ...

    def weights(self) -> WeightStream: ...


def check_prompts(prompts: Sequence[Sequence[int]], max_new_tokens: int, limit: int,
                  limit_name: str) -> None:
    """Refuse prompts that are empty or leave no room for `max_new_tokens` within the
    model's `limit` of positions (named `limit_name`), listing them."""
    too_long = [i for i, p in enumerate(prompts) if len(p) + max_new_tokens > limit]
    if too_long or any(len(p) == 0 for p in prompts):
        raise ValueError(f"prompts {too_long or 'with no tokens'} do not fit: each needs "
                         f"1 <= prompt + max_new_tokens ({max_new_tokens}) <= "
                         f"{limit_name} ({limit})")
