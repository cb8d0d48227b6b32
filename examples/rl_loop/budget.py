"""The slots' memory budget: `run.policy` and `run.slot_memory` turned into the arbiter's
config, and the fewest bytes a capacity requires a step to copy, which the summary and
bench/budget.py hold the measured bytes against.

Sizes are estimated per slot before anything starts, from the model's parameters on the
meta device, as each slot holds them: the trainer its weights, AdamW's two moments and a
step count per tensor, and its gradients (DDP: the whole model on every slot; FSDP: the
slot's shard of each parameter, dim 0 split as `torch.chunk` splits it), the reference its
weights laid out like the trainer's, the generator its weights (a torch generator: whole,
one replica per slot; vLLM: its tensor-parallel share, one replica over the slots or one
per model copy alike) and the working memory of a batch (KV cache and logits) as it
declares it. The arbiter measures the real sizes at each switch.

`run.slot_memory=auto`: on a GPU, the device's own memory, measured by NVML at each
switch; on CPU slots (which have no capacity of their own) a capacity below what the
tenants hold together, so that they take turns: 1.3x the largest tenant, but at most 0.9x
all of them, and never less than 1.05x the largest (one tenant far larger than the others
must still fit).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from colocate import ArbiterConfig
from colocate.arbiter.slot import SlotTraffic
from colocate.engines.generator import KV_BLOCK_TOKENS, kv_cache_bytes, working_bytes
from colocate.memory import Traffic
from colocate.resources.manager import ResourceManager
from examples.rl_loop.config import RLConfig
from examples.rl_loop.sources import within_served
from services import Service

# stage -> (bytes in weights' units, kept across a sleep): what each tenant holds, as the
# loop's engines tag them (colocate/engines: trainer, generator with keep_weights=False,
# reference)
STAGES = {
    "trainer": {"weights": (1, True), "optimizer": (2, True), "grads": (1, False)},
    "generator": {"weights": (1, False)},
    "reference": {"weights": (1, True)},
}


@dataclass(frozen=True)
class Size:
    """One tenant's estimated memory: stage -> (bytes, kept across a sleep), the working
    memory its calls take beside them, and stage -> its number of tensors."""

    stages: dict[str, tuple[int, bool]]
    working: int = 0
    tensors: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(b for b, _ in self.stages.values()) + self.working


def tenant_sizes(cfg: RLConfig, model: Path | transformers.PretrainedConfig,
                 rank: int | None = 0) -> dict[str, Size]:
    """Each tenant's size on slot `rank` (see module; None: as if unsharded, the whole
    model on the slot), in the order they take their turns in a step: generator, reference
    (grpo.beta > 0), trainer. `model`: the model's directory, or its config."""
    config = model if isinstance(model, transformers.PretrainedConfig) \
        else transformers.AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    params = list(model.parameters())  # tied: once
    whole = sum(p.numel() * p.element_size() for p in params)
    slots, world = cfg.run.slots, cfg.run.slots * cfg.run.hosts  # the trainer's ranks
    sharded = cfg.trainer.parallel == "fsdp" and world > 1 and rank is not None
    mine = sum(shard_bytes(p, rank or 0, world) for p in params) if sharded else whole
    tenants = ["generator"] + (["reference"] if cfg.grpo.beta > 0 else []) + ["trainer"]
    sizes = {t: {s: (units * mine, kept) for s, (units, kept) in STAGES[t].items()}
             for t in tenants}
    sizes["trainer"]["optimizer"] = (2 * mine + 4 * len(params), True)
    # a tensor per parameter in each stage; AdamW's state is three (two moments, a step)
    tensors = {t: {s: len(params) for s in stages} for t, stages in sizes.items()}
    tensors["trainer"]["optimizer"] = 3 * len(params)
    shape = (config.to_dict(), cfg.generator.max_batch,
             within_served(config.max_position_embeddings, cfg.served_positions))
    if cfg.run.engine == "vllm":  # its KV cache a stage of its own
        tp = cfg.generator.tensor_parallel_size if slots > 1 else 1
        block = cfg.generator.block_size or KV_BLOCK_TOKENS  # as the engine sizes it
        sizes["generator"] = {"weights": (whole // tp, False),
                              "kv_cache": (kv_cache_bytes(*shape, block, tp), False)}
        tensors["generator"]["kv_cache"] = config.num_hidden_layers
        return {t: Size(stages, 0, tensors[t]) for t, stages in sizes.items()}
    sizes["generator"]["weights"] = (whole, False)
    working = {"generator": working_bytes(*shape) + (cfg.generator.session_cache_mb << 20)}
    return {t: Size(stages, working.get(t, 0), tensors[t]) for t, stages in sizes.items()}


def shard_bytes(param: torch.Tensor, rank: int, world: int) -> int:
    """The bytes of rank `rank`'s FSDP shard of `param` (dim 0 in `world` chunks)."""
    rows = param.shape[0]
    chunk = -(-rows // world)
    mine = max(0, min(chunk, rows - rank * chunk))
    return mine * (param.numel() // rows) * param.element_size()


def slot_sizes(cfg: RLConfig, model_dir: Path | transformers.PretrainedConfig
               ) -> list[dict[str, Size]]:
    """The tenants each slot of the run holds, with their sizes there: colocated, all of
    them on each of `run.slots` of every host (in rank order); apart
    (`run.colocate=false`), the trainer (and the reference) on those and the generator alone
    on as many more."""
    per_rank = [tenant_sizes(cfg, model_dir, rank)
                for rank in range(cfg.run.slots * cfg.run.hosts)]
    if cfg.run.colocate:
        return per_rank
    return ([{t: s for t, s in sizes.items() if t != "generator"} for sizes in per_rank]
            + [{"generator": sizes["generator"]} for sizes in per_rank])


def parse_bytes(value: str) -> int:
    """`run.slot_memory` or `run.host_memory` as bytes: an integer, optionally with KiB,
    MiB, GiB or TiB."""
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
    text = str(value).strip()
    for suffix, scale in units.items():
        if text.endswith(suffix):
            return int(float(text[:-len(suffix)]) * scale)
    return int(text)


def auto_capacity(sizes: dict[str, Size]) -> int:
    """CPU slots' `auto` capacity for a slot holding `sizes` (see module)."""
    totals = [size.total for size in sizes.values()]
    return int(max(1.05 * max(totals), min(1.3 * max(totals), 0.9 * sum(totals))))


def arbiter_config(cfg: RLConfig, model_dir: Path | transformers.PretrainedConfig,
                   on_gpu: bool) -> ArbiterConfig:
    """The arbiter's config for the run's policy, slot memory and bound on a call to a
    proc (`run.call_timeout_s`)."""
    run = cfg.run
    if run.call_timeout_s:
        unbound = dataclasses.replace(cfg, run=dataclasses.replace(run, call_timeout_s=0.0))
        return dataclasses.replace(arbiter_config(unbound, model_dir, on_gpu),
                                   call_timeout_s=run.call_timeout_s)
    if run.policy == "exclusive":
        return ArbiterConfig(policy="exclusive")
    if run.slot_memory != "auto":
        return ArbiterConfig(policy="budget", slot_capacity_bytes=parse_bytes(run.slot_memory))
    # the whole model's sizes: a sharded trainer holds less, and the capacity errs roomy
    # (every tenant is spawned awake, so each must find room beside the others)
    capacity = None if on_gpu else auto_capacity(tenant_sizes(cfg, model_dir, rank=None))
    return ArbiterConfig(policy="budget", slot_capacity_bytes=capacity)


def required_per_step(sizes: dict[str, Size], capacity: int) -> int:
    """The fewest bytes a step must copy to host memory and back on a slot of `capacity`
    holding `sizes`: while each tenant works (its stages and working memory), the others'
    kept stages must fit beside it, or be out (their dropped ones go free). A stage out is
    copied out and back in once a step (each tenant's turn comes once, so the phases it
    sits out are consecutive), and stages go whole: the cheapest set of kept stages whose
    absence lets every turn fit."""
    kept = [(tenant, stage, b) for tenant, size in sizes.items()
            for stage, (b, k) in size.stages.items() if k]

    def fits(out: set[tuple[str, str]]) -> bool:
        return all(size.total + sum(b for t, s, b in kept if t != awake and (t, s) not in out)
                   <= capacity for awake, size in sizes.items())

    costs = [2 * sum(b for _, _, b in out) for n in range(len(kept) + 1)
             for out in itertools.combinations(kept, n)
             if fits({(t, s) for t, s, _ in out})]
    return min(costs, default=2 * sum(b for _, _, b in kept))


def budget_summary(cfg: RLConfig, config: ArbiterConfig, model_dir: Path) -> dict[str, Any]:
    """The run's policy and slot capacity and, under a budget of known capacity, the bytes
    that capacity requires a step to copy, per slot and summed over the run's slots
    (`required_per_step` of each slot's estimated sizes)."""
    capacity = config.slot_capacity_bytes
    found: dict[str, Any] = {"policy": cfg.run.policy, "slot_capacity_bytes": capacity}
    if capacity is not None and config.policy == "budget":
        per_slot = [required_per_step(sizes, capacity)
                    for sizes in slot_sizes(cfg, model_dir)]
        found["bytes_required_per_slot"] = per_slot
        found["bytes_required_per_step"] = sum(per_slot)
    return found


class StepTraffic:
    """What the switches moved, step by step: the arbiters' counts (`rm.traffic()`), read
    after each step, less those read after the one before."""

    def __init__(self, rm: ResourceManager) -> None:
        self.rm = rm
        self.seen: dict[tuple[int, int], SlotTraffic] = {}

    async def since_last(self, services: dict[str, Service]) -> dict[str, Any]:
        """The bytes copied out to host memory, in from it and discarded since the last
        call, each service's stages' sleeps ("service/stage" -> count), the most a slot
        held after a switch so far, and the most host memory the slots' backups held so
        far (each slot's most, summed)."""
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
                "slot_peak_bytes": max((t.peak_bytes for t in now.values()), default=0),
                "backup_peak_bytes": sum(t.backup_peak_bytes for t in now.values())}
