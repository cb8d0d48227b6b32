"""The RL loop's plan: which tenants each slot holds and their sizes, the turns of a step,
and a finished run's figures held against the plan.

The generic part is `colocate.planning`; here is what the loop knows: the tenants of each
slot (the trainer, the generator and, with grpo.beta > 0, the reference, spawned in that
order, sized by budget.py from the model's config on the meta device: nothing is loaded),
the turns of a sync step (the generator generates, the reference's turn, the trainer's,
then the sync) after the first sync at start, the slots' capacity (`run.slot_memory`, as
the arbiter is told it) and the loop's own process (`Rates.process_bytes`, measured by
`python -m examples.rl_loop --calibrate`; else this process's memory now, less than a run
holds).

A run's measured figures (`measured`): from the second step on (the first starts with
nothing out yet), the bytes copied to host memory and back per step (the mean); the
switch + sync time of the median step (the generator's wake; the trainer's wake, started
ahead, its own duration; with a reference, the trainer's wake after it too; and the sync);
the most a slot held after a switch; the host's peak, the loop process's peak RSS and the
most the slots' backups held.
Partial rollouts, tools and environments change the turns; the plan is a sync step's.
"""

from __future__ import annotations

import resource
import statistics
from pathlib import Path
from typing import Any

import psutil
import transformers

from colocate.arbiter.host_budget import host_capacity as host_budget_capacity
from colocate.engines.tiny import tiny_config
from colocate.planning import Plan, Sync, TenantSpec, Turn, Wake, check, plan_run
from colocate.planning.rates import Rates
from examples.rl_loop.budget import arbiter_config, slot_sizes
from examples.rl_loop.config import RLConfig
from examples.rl_loop.host_memory import host_fields

SPAWN_ORDER = ("trainer", "generator", "reference")


def model_config(cfg: RLConfig, alphabet: str) -> transformers.PretrainedConfig:
    """The model's config: `model.path`'s config.json, or the tiny model's fields (over
    the task's characters, `alphabet`), nothing written or loaded."""
    m = cfg.model
    if m.path is not None:
        return transformers.AutoConfig.from_pretrained(m.path)
    return tiny_config(m.architecture, alphabet, m.hidden_size, m.layers, m.heads, m.kv_heads,
                       m.intermediate_size, m.max_positions, init_std=m.init_std)


def tenants(cfg: RLConfig, model: Path | transformers.PretrainedConfig
            ) -> list[list[TenantSpec]]:
    """Each slot's tenants, in the order they are spawned, with their sizes there."""
    return [[TenantSpec(name, sizes[name].stages, sizes[name].working, sizes[name].tensors)
             for name in SPAWN_ORDER if name in sizes]
            for sizes in slot_sizes(cfg, model)]


def turns(cfg: RLConfig) -> tuple[list[Turn], list[Turn]]:
    """The turns at start (the first sync) and those of a step."""
    sync = Sync("trainer", "generator")
    reference = [Wake("reference")] if cfg.grpo.beta > 0 else []
    return [sync], [Wake("generator"), *reference, Wake("trainer"), sync]


def make_plan(cfg: RLConfig, model: Path | transformers.PretrainedConfig, rates: Rates
              ) -> Plan:
    """The run's plan (see module) on the machine `rates` were measured on (a GPU's: its
    backups pinned), which need not be this one: its capacity as the arbiter is told it
    (on a GPU with `auto`, the device's memory, as the rates file says it, else this
    machine's GPU's), and its hosts' memory for backups as their arbiters are told it
    (`run.host_memory`; `auto`, this machine's: a plan for another node gives that
    node's), past which backups go to disk (`run.backup_dir`)."""
    capacity = arbiter_config(cfg, model, rates.on_gpu).slot_capacity_bytes
    if capacity is None and rates.on_gpu:
        capacity = rates.slot_bytes or _this_gpus_memory(rates.device)
    start, step = turns(cfg)
    process = rates.process_bytes or psutil.Process().memory_info().rss
    per_host = cfg.run.slots * (1 if cfg.run.colocate else 2)
    host = host_fields(cfg.run)
    plan = plan_run(tenants(cfg, model), step, capacity, rates, cfg.run.policy, start,
                    host_other_bytes=process, pinned=rates.on_gpu, slots_per_host=per_host,
                    host_budget=host["host_capacity_bytes"] or host_budget_capacity(),
                    backup_dir=host["backup_dir"])
    plan.notes["process_bytes_measured"] = bool(rates.process_bytes)
    return plan


def _this_gpus_memory(device: str) -> int:
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"run.slot_memory=auto plans for a GPU ({device}, as the rates "
                         "file says) need its memory, which the file does not give (it "
                         "predates slot_bytes): give run.slot_memory, e.g. 80GiB, or "
                         "calibrate the rates on that GPU again")
    return torch.cuda.get_device_properties(0).total_memory


def measured(steps: list[dict[str, Any]], summary: dict[str, Any], reference: bool
             ) -> dict[str, float]:
    """A finished run's figures, named as `colocate.planning.TARGETS` names them, from its
    step rows (the untrained evaluation's left out) and its summary (see module)."""
    steady = steps[1:] or steps

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    switch = [generator_wake(s) + s["switch_ahead_s"] + s["sync_s"] + (
        s["switch_s"] - s["reference_switch_s"] - generator_wake(s) if reference else 0.0)
        for s in steady]
    switch_time = statistics.median(switch)  # the median step: the machine's other load
    # (a stray process, a collection) lands on some steps, not on the switches' cost
    backups = max((s.get("backup_peak_bytes", 0) for s in steps), default=0)
    process = loop_peak_bytes()
    return {"bytes_moved": mean([s["copied_out_bytes"] + s["copied_in_bytes"]
                                 for s in steady]),
            "switch_time": switch_time, "peak_slot": summary["slot_peak_bytes"],
            "peak_host": process + backups, "process_bytes": process,
            "host_backup_bytes": backups}


def generator_wake(step: dict[str, Any]) -> float:
    """A step's wait for the generator's wake (a row written before it was its own figure,
    by a run resumed here: none counted)."""
    return step.get("generator_switch_s", 0.0)


def loop_peak_bytes() -> int:
    """The most memory this process (the loop's) has held so far (its peak RSS)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def predicted(plan: dict[str, Any]) -> dict[str, float]:
    """A plan's figures (`Plan.as_dict()`), named as `TARGETS` names them."""
    figures = plan["predicted"]
    return {"bytes_moved": figures["bytes_moved_per_step"],
            "switch_time": figures["switch_time_per_step_s"],
            "peak_slot": figures["peak_slot_bytes"], "peak_host": figures["peak_host_bytes"]}


def plan_check(plan: dict[str, Any], steps: list[dict[str, Any]], summary: dict[str, Any],
               reference: bool) -> dict[str, Any]:
    """The run's summary's `plan` entry: each figure predicted beside measured, with its
    error and target (`colocate.planning.check`)."""
    found = measured(steps, summary, reference)
    return {**check(predicted(plan), found), "fits": plan["fits"], "why": plan["why"],
            "measured_process_bytes": found["process_bytes"],
            "measured_host_backup_bytes": found["host_backup_bytes"]}


def describe(plan: dict[str, Any]) -> str:
    """The plan in words, as `--plan` prints it."""
    mib = 2 ** 20
    figures = plan["predicted"]
    lines = [f"policy {plan['policy']}; fits: {'yes' if plan['fits'] else 'no: ' + plan['why']}"]
    for index, slot in enumerate(plan["slots"]):
        capacity = slot["capacity_bytes"]
        lines.append(f"slot {index}: capacity "
                     f"{'unknown' if capacity is None else f'{capacity / mib:.2f} MiB'}")
        for name, tenant in slot["tenants"].items():
            stages = ", ".join(f"{stage} {s['bytes'] / mib:.3f} MiB"
                               f"{'' if s['kept'] else ' (dropped at a sleep)'}"
                               for stage, s in tenant["stages"].items())
            lines.append(f"  {name}: {stages}; working {tenant['working_bytes'] / mib:.3f} MiB")
        lines.append(f"  peak {slot['peak_bytes'] / mib:.3f} MiB; a step moves "
                     f"{slot['moved_per_step'] / mib:.3f} MiB to host memory and back")
        for switch in slot["step"]:
            what = "; ".join(filter(None, [
                "slept " + ", ".join(switch["slept"]) if switch["slept"] else "",
                "woke " + ", ".join(switch["woken"]) if switch["woken"] else "",
                f"copied {switch['in_slot_bytes']} in the slot" if switch["in_slot_bytes"]
                else ""])) or "nothing moves"
            lines.append(f"    {switch['turn']:28} {switch['way']:9} "
                         f"{switch['seconds'] * 1e3:8.2f} ms  {what}")
    lines += [f"per step: {figures['bytes_moved_per_step'] / mib:.3f} MiB moved, switch "
              f"{figures['switch_s_per_step'] * 1e3:.2f} ms + sync "
              f"{figures['sync_s_per_step'] * 1e3:.2f} ms",
              f"peak slot memory {figures['peak_slot_bytes'] / mib:.3f} MiB; peak host memory "
              f"{figures['peak_host_bytes'] / mib:.1f} MiB (backups "
              f"{figures['host_backup_bytes'] / mib:.3f} MiB, the loop's process "
              f"{plan['host_other_bytes'] / mib:.1f} MiB"
              f"{'' if plan.get('process_bytes_measured') else ', not calibrated'})"]
    rates = plan["rates"]
    lines.append(f"rates ({rates['device']}, {rates['measured_at']}): backup out "
                 f"{rates['backup_out'] / 1e9:.2f} GB/s, in {rates['backup_in'] / 1e9:.2f} "
                 f"GB/s, in-slot copy {rates['in_slot'] / 1e9:.2f} GB/s; fixed per switch "
                 + (", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in rates["fixed_s"].items())
                    or "not calibrated (python -m examples.rl_loop --calibrate)"))
    return "\n".join(lines)


def rates_for(cfg: RLConfig, path: str | None = None) -> Rates:
    """The rates a plan is priced with: the file `path` (or `run.rates`) names, else this
    machine's own (`colocate.planning.cached_rates`: calibrated once, then read)."""
    import torch

    from colocate.planning import cached_rates, load_rates

    path = path or cfg.run.rates
    if path:
        return load_rates(Path(path))
    return cached_rates("cuda" if torch.cuda.is_available() else "cpu")


def print_plan(cfg: RLConfig, out: str | None = None) -> bool:
    """`--plan`: the run's plan printed and written as JSON to `out` (default
    run.out/plan.json), nothing started; returns whether it fits. The prompts and reward
    functions are checked as a run checks them (the tiny model's characters come from
    them)."""
    import json

    from examples.rl_loop.sources import make_source

    source = make_source(cfg)
    try:
        model = Path(cfg.model.path) if cfg.model.path else model_config(cfg, source.alphabet)
    finally:
        source.close()
    plan = make_plan(cfg, model, rates_for(cfg)).as_dict()
    path = Path(out) if out else Path(cfg.run.out) / "plan.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=2))
    print(describe(plan))
    print(f"wrote {path}")
    return plan["fits"]


def plan_for_run(cfg: RLConfig, model_dir: Path, out: Path) -> dict[str, Any]:
    """A run's plan, made as it starts and written to `out`/plan.json."""
    import json

    plan = make_plan(cfg, model_dir, rates_for(cfg)).as_dict()
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(plan, indent=2))
    return plan
