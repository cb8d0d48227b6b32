"""vLLM's memory as a tenant's two stages, "weights" (kept across a sleep) and "kv_cache"
(dropped): `ArenaSleep` on CPU, each stage a `colocate.memory` tag of vLLM's worker (its
worker extension, reached by `collective_rpc`); `NativeSleep` on CUDA, vLLM's own sleep
mode (level 1 keeps the weights in host memory and drops the cache, so a sleep of one
stage sleeps both and wakes the other again).

The weights are refillable: a sleep may drop them instead of keeping a copy (the arbiter's
choice, place "drop", when the host has no room for it; always, with `keep_weights=False`,
for an engine whose every wake comes with new weights, as an RL loop's sync gives). On
CUDA that is vLLM's level 2, which keeps only the model's buffers. Dropped weights are
`lost` until the generator loads new ones (`refilled`), and it refuses to generate before.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
import vllm

from colocate import memory, telemetry
from colocate.arbiter.tenant import TenantInfo

STAGES = ("weights", "kv_cache")  # wake order


class VLLMTenancy(ABC):
    """The vLLM engine's tenancy on this rank (each rank of a multi-rank engine has its own,
    called by its own slot's arbiter): the stage checks here; a subclass sleeps, wakes and
    describes the stages its way. A sleep happens inside `guard` (the generator's: once no
    continuous call is in flight)."""

    guard: Callable[[], AbstractContextManager] = nullcontext
    keep_weights: bool = True
    lost: frozenset[str] = frozenset()  # stages dropped at a sleep and not refilled since

    def sleep(self, stages: Sequence[str] | None = None,
              places: Mapping[str, str] | None = None) -> int:
        """Release `stages` (default: all) that are awake, kept ones at their `places`
        (default: host memory; "drop" for the weights: see module); returns the bytes they
        held."""
        _check_stages(stages or ())
        places = dict(places or {})
        if not self.keep_weights:
            places["weights"] = memory.DROP
        with self.guard():
            todo = STAGES if stages is None else tuple(stages)
            if "weights" in todo and places.get("weights") == memory.DROP \
                    and "weights" in self.awake_stages():
                self.lost = self.lost | {"weights"}
            return self._sleep(todo, places)

    def refilled(self, stage: str) -> None:
        """Say that `stage` holds good contents again (new weights were loaded)."""
        self.lost = self.lost - {stage}

    def wake(self, stages: Sequence[str]) -> None:
        """Bring `stages` back, in that order; awake stages are left as they are."""
        _check_stages(stages)
        self._wake(tuple(stages))

    def awake_stages(self) -> tuple[str, ...]:
        return self.describe().awake_stages

    @abstractmethod
    def _sleep(self, stages: tuple[str, ...], places: dict[str, str]) -> int:
        """Release those of `stages` that are awake, kept ones at their `places`; returns
        the bytes they held."""

    @abstractmethod
    def _wake(self, stages: tuple[str, ...]) -> None:
        """Bring back those of `stages` that sleep, in that order."""

    @abstractmethod
    def describe(self) -> TenantInfo: ...


class ArenaSleep(VLLMTenancy):
    """CPU: each stage is a `colocate.memory` tag of the worker's process, under the
    worker's own `TaggedTenant` (reached by `collective_rpc`; this rank's worker only)."""

    def __init__(self, llm: vllm.LLM, prefix: str,
                 guard: Callable[[], AbstractContextManager] = nullcontext,
                 keep_weights: bool = True) -> None:
        self.llm, self.guard, self.keep_weights = llm, guard, keep_weights
        llm.collective_rpc("colocate_adopt", args=(prefix, keep_weights))

    def _sleep(self, stages: tuple[str, ...], places: dict[str, str]) -> int:
        if "kv_cache" in stages:
            self.llm.reset_prefix_cache()  # the cache's contents are dropped
        return self.llm.collective_rpc("colocate_sleep", args=(list(stages), places))[0]

    def _wake(self, stages: tuple[str, ...]) -> None:
        self.llm.collective_rpc("colocate_wake", args=(list(stages),))

    def describe(self) -> TenantInfo:
        return self.llm.collective_rpc("colocate_describe")[0]


class NativeSleep(VLLMTenancy):
    """CUDA: vLLM's sleep mode; level 1 keeps the weights in host memory and drops the
    cache, level 2 (weights dropped) keeps only the model's buffers."""

    def __init__(self, llm: vllm.LLM,
                 guard: Callable[[], AbstractContextManager] = nullcontext,
                 keep_weights: bool = True) -> None:
        self.llm, self.guard, self.keep_weights = llm, guard, keep_weights
        self.pid, self.nbytes = llm.collective_rpc("colocate_sizes")[0]
        self.awake = set(STAGES)

    def _sleep(self, stages: tuple[str, ...], places: dict[str, str]) -> int:
        if any(place not in (memory.HOST, memory.DROP) for place in places.values()):
            raise ValueError(f"vLLM's own sleep mode keeps its weights in host memory or "
                             f"drops them; it cannot put them elsewhere ({places}): give "
                             "the host more memory for backups (run.host_memory)")
        todo = [stage for stage in STAGES if stage in stages and stage in self.awake]
        if not todo:
            return 0
        keep = tuple(stage for stage in STAGES if stage in self.awake and stage not in todo)
        # level 2 only when the weights go: a level-2 sleep would lose weights woken again
        drop = "weights" in todo and places.get("weights") == memory.DROP
        self.llm.sleep(level=2 if drop else 1)
        self.awake.clear()
        self._wake(keep)
        return sum(self.nbytes[stage] for stage in todo)

    def _wake(self, stages: tuple[str, ...]) -> None:
        for stage in stages:
            if stage not in self.awake:
                self.llm.wake_up(tags=[stage])
                self.awake.add(stage)

    def describe(self) -> TenantInfo:
        awake = tuple(stage for stage in STAGES if stage in self.awake)
        return TenantInfo(pid=self.pid, device=telemetry.device_uuid(torch.cuda.current_device()),
                          stages=STAGES, awake_stages=awake,
                          resident_bytes=sum(self.nbytes[s] for s in awake),
                          tagged_bytes=sum(self.nbytes.values()), stage_bytes=self.nbytes,
                          # level 1 keeps them in host memory, level 2 drops them
                          kept=("weights",) if self.keep_weights else (),
                          refillable=("weights",) if self.keep_weights else ())


def _check_stages(stages: Iterable[str]) -> None:
    unknown = [stage for stage in stages if stage not in STAGES]
    if unknown:
        raise KeyError(f"unknown stage(s) {unknown}; stages are {list(STAGES)}")
