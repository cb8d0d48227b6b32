"""vLLM's memory as a tenant's two stages, "weights" (kept across a sleep) and "kv_cache"
(dropped): `ArenaSleep` on CPU, each stage a `colocate.memory` tag of vLLM's worker (its
worker extension, reached by `collective_rpc`); `NativeSleep` on CUDA, vLLM's own sleep
mode (level 1 keeps the weights in host memory and drops the cache, so a sleep of one
stage sleeps both and wakes the other again)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
import vllm

from colocate import telemetry
from colocate.arbiter.tenant import TenantInfo

STAGES = ("weights", "kv_cache")  # wake order


class VLLMTenancy(ABC):
    """The vLLM engine's tenancy on this rank (each rank of a multi-rank engine has its own,
    called by its own slot's arbiter): the stage checks here; a subclass sleeps, wakes and
    describes the stages its way. A sleep happens inside `guard` (the generator's: once no
    continuous call is in flight)."""

    guard: Callable[[], AbstractContextManager] = nullcontext

    def sleep(self, stages: Sequence[str] | None = None,
              places: Mapping[str, str] | None = None) -> int:
        """Release `stages` (default: all) that are awake, kept ones at their `places`
        (default: host memory); returns the bytes they held."""
        _check_stages(stages or ())
        with self.guard():
            return self._sleep(STAGES if stages is None else tuple(stages),
                               dict(places or {}))

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
                 guard: Callable[[], AbstractContextManager] = nullcontext) -> None:
        self.llm, self.guard = llm, guard
        llm.collective_rpc("colocate_adopt", args=(prefix,))

    def _sleep(self, stages: tuple[str, ...], places: dict[str, str]) -> int:
        if "kv_cache" in stages:
            self.llm.reset_prefix_cache()  # the cache's contents are dropped
        return self.llm.collective_rpc("colocate_sleep", args=(list(stages), places))[0]

    def _wake(self, stages: tuple[str, ...]) -> None:
        self.llm.collective_rpc("colocate_wake", args=(list(stages),))

    def describe(self) -> TenantInfo:
        return self.llm.collective_rpc("colocate_describe")[0]


class NativeSleep(VLLMTenancy):
    """CUDA: vLLM's sleep mode; level 1 keeps the weights in host memory, drops the cache."""

    def __init__(self, llm: vllm.LLM,
                 guard: Callable[[], AbstractContextManager] = nullcontext) -> None:
        self.llm, self.guard = llm, guard
        self.pid, self.nbytes = llm.collective_rpc("colocate_sizes")[0]
        self.awake = set(STAGES)

    def _sleep(self, stages: tuple[str, ...], places: dict[str, str]) -> int:
        if any(place != "host" for place in places.values()):
            raise ValueError(f"vLLM's own sleep mode keeps its weights in host memory; it "
                             f"cannot put them elsewhere ({places}): give the host more "
                             "memory for backups (run.host_memory)")
        todo = [stage for stage in STAGES if stage in stages and stage in self.awake]
        if not todo:
            return 0
        keep = tuple(stage for stage in STAGES if stage in self.awake and stage not in todo)
        self.llm.sleep(level=1)
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
                          kept=("weights",))  # level 1 keeps them in host memory


def _check_stages(stages: Iterable[str]) -> None:
    unknown = [stage for stage in stages if stage not in STAGES]
    if unknown:
        raise KeyError(f"unknown stage(s) {unknown}; stages are {list(STAGES)}")
