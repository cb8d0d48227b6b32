"""The slots' memory budget: this module's one job is to turn `run.policy` and
`run.slot_memory` into the arbiter's config, and to say how many bytes a capacity
requires a step to copy, which the summary and bench/budget.py hold the measured bytes
against.

`run.slot_memory=auto`: on a GPU, the device's own memory, measured by NVML at each
switch; on CPU slots (which have no capacity of their own) a capacity below what the
tenants hold together, so that they take turns: 1.3x the largest tenant, but at most 0.9x
all of them, from sizes estimated before anything starts (the model's parameters on the
meta device: the trainer holds weights, AdamW's two moments and gradients; the generator and
the reference their weights, and the generator works in a batch's KV cache and logits, as it
declares). The arbiter measures the real sizes at each switch.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from colocate import ArbiterConfig
from colocate.arbiter.slot import SlotTraffic
from colocate.engines.generator import kv_cache_bytes, working_bytes
from colocate.memory import Traffic
from colocate.resources.manager import ResourceManager
from examples.rl_loop.config import RLConfig
from services import Service

# stage -> (bytes in weights' units, kept across a sleep): what each tenant holds, as the
# engines tag it (colocate/engines: trainer, generator with keep_weights=False, reference)
STAGES = {
    "trainer": {"weights": (1, True), "optimizer": (2, True), "grads": (1, False)},
    "generator": {"weights": (1, False)},
    "reference": {"weights": (1, True)},
}


@dataclass(frozen=True)
class Size:
    """One tenant's estimated memory: stage -> (bytes, kept across a sleep), and the
    working memory its calls take beside them."""

    stages: dict[str, tuple[int, bool]]
    working: int = 0

    @property
    def total(self) -> int:
        return sum(b for b, _ in self.stages.values()) + self.working


def tenant_sizes(cfg: RLConfig, model_dir: Path) -> dict[str, Size]:
    """Each tenant's size, estimated (see module); AdamW also keeps a float32 step count
    per parameter tensor."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    params = list(model.parameters())  # tied: once
    weights = sum(p.numel() * p.element_size() for p in params)
    tenants = ["trainer", "generator"] + (["reference"] if cfg.grpo.beta > 0 else [])
    sizes = {t: {s: (units * weights, kept) for s, (units, kept) in STAGES[t].items()}
             for t in tenants}
    sizes["trainer"]["optimizer"] = (2 * weights + 4 * len(params), True)
    shape = (config.to_dict(), cfg.generator.max_batch, config.max_position_embeddings)
    if cfg.run.engine == "vllm":  # its weights kept across a sleep, its KV cache a stage
        sizes["generator"] = {"weights": (weights, True),
                              "kv_cache": (kv_cache_bytes(*shape), False)}
        return {t: Size(stages) for t, stages in sizes.items()}
    working = {"generator": working_bytes(*shape)}
    return {t: Size(stages, working.get(t, 0)) for t, stages in sizes.items()}


def parse_bytes(value: str) -> int:
    """`run.slot_memory` as bytes: an integer, optionally with KiB, MiB or GiB."""
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    text = str(value).strip()
    for suffix, scale in units.items():
        if text.endswith(suffix):
            return int(float(text[:-len(suffix)]) * scale)
    return int(text)


def auto_capacity(sizes: dict[str, Size]) -> int:
    """CPU slots' `auto` capacity (see module)."""
    totals = [size.total for size in sizes.values()]
    return int(min(1.3 * max(totals), 0.9 * sum(totals)))


def arbiter_config(cfg: RLConfig, model_dir: Path, on_gpu: bool) -> ArbiterConfig:
    """The arbiter's config for the run's policy and slot memory."""
    run = cfg.run
    if run.policy == "exclusive":
        return ArbiterConfig(policy="exclusive")
    if run.slot_memory != "auto":
        return ArbiterConfig(policy="budget", slot_capacity_bytes=parse_bytes(run.slot_memory))
    capacity = None if on_gpu else auto_capacity(tenant_sizes(cfg, model_dir))
    return ArbiterConfig(policy="budget", slot_capacity_bytes=capacity)


def required_per_step(sizes: dict[str, Size], capacity: int) -> int:
    """The fewest bytes a step must copy to host memory and back under `capacity`, for the
    trainer and the generator: while one of them works (its stages and working memory),
    the other's kept stages beyond the room left hold out (its dropped ones go free); each
    stage out is copied out and back in once a step, and stages go whole."""
    required = 0
    for awake, other in (("generator", "trainer"), ("trainer", "generator")):
        room = capacity - sizes[awake].total
        kept = [b for b, k in sizes[other].stages.values() if k]
        overflow = sum(kept) - room
        if overflow > 0:
            required += 2 * min((sum(c) for n in range(1, len(kept) + 1)
                                 for c in itertools.combinations(kept, n)
                                 if sum(c) >= overflow), default=sum(kept))
    return required


def budget_summary(cfg: RLConfig, config: ArbiterConfig, model_dir: Path) -> dict[str, Any]:
    """The run's policy and slot capacity and, for a trainer and a generator on a capacity
    (no reference), the bytes that capacity requires a step to copy (`required_per_step`
    of the estimated sizes)."""
    capacity = config.slot_capacity_bytes
    found: dict[str, Any] = {"policy": cfg.run.policy, "slot_capacity_bytes": capacity}
    if capacity is not None and cfg.grpo.beta == 0 and config.policy == "budget":
        found["bytes_required_per_step"] = required_per_step(tenant_sizes(cfg, model_dir),
                                                             capacity)
    return found


class StepTraffic:
    """What the switches moved, step by step: the arbiters' counts (`rm.traffic()`), read
    after each step, less those read after the one before."""

    def __init__(self, rm: ResourceManager) -> None:
        self.rm = rm
        self.seen: dict[tuple[int, int], SlotTraffic] = {}

    async def since_last(self, services: dict[str, Service]) -> dict[str, Any]:
        """The bytes copied out to host memory, in from it and discarded since the last
        call, each service's stages' sleeps ("service/stage" -> count), and the most a slot
        held after a switch so far."""
        now = {(h, s): t for h, slots in (await self.rm.traffic()).items()
               for s, t in slots.items()}
        owner = {tenant: name for name, service in services.items()
                 for tenant in service.tenant_names()}
        moved, slept = Traffic(), Counter[str]()
        for key, t in now.items():
            before = self.seen.get(key, SlotTraffic())
            moved += t.moved.since(before.moved)
            for (tenant, stage), count in t.slept.items():
                if tenant in owner and count > before.slept.get((tenant, stage), 0):
                    slept[f"{owner[tenant]}/{stage}"] += count - before.slept.get(
                        (tenant, stage), 0)
        self.seen = now
        return {"copied_out_bytes": moved.copied_out, "copied_in_bytes": moved.copied_in,
                "discarded_bytes": moved.discarded, "slept": dict(sorted(slept.items())),
                "slot_peak_bytes": max((t.peak_bytes for t in now.values()), default=0)}
