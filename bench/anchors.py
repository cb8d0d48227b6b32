"""What the plan says for a 7B and a 32B model on one node of 8 H100s, before any run: the
table of docs/plan_anchors.md, made on any machine (nothing starts, no weights exist).

Each model is its published config (Qwen2.5-7B and Qwen2.5-32B: `MODELS`), built on the meta
device by the plan as a run's would be. The run: the RL loop with a vLLM generator, the
trainer FSDP over the node's 8 GPUs (`run.slots=8`, one host), the budget policy with each
slot the GPU's memory (`run.slot_memory=auto`), and the host's memory for backups
(`run.host_memory`, 256 GiB and 1 TiB). The loop holds every copy in float32 (the trainer's and
vLLM's weights, the KV cache) and sizes vLLM's KV cache for `generator.max_batch` sequences
of `generator.max_model_len` tokens, `SEQUENCE` here.

The rates: a rates file measured on the GPU (`--rates FILE`, as `tests/gpu/device.sh run`
brings back), else `H100`: the H100 figures of bench/RESULTS.md ("One H100, `device.sh
run`"), put together by hand where no calibration of this kind ran there (see its fields).

    .venv/bin/python -m bench.anchors [--rates FILE] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import transformers

from colocate.planning import Rates, load_rates
from examples.rl_loop.config import load_config
from examples.rl_loop.plan import make_plan

SEQUENCE = 4096  # prompt and completion, the tokens a sequence's KV cache holds
# the published configs' fields (Qwen/Qwen2.5-7B-Instruct, Qwen/Qwen2.5-32B-Instruct on the
# Hugging Face hub)
MODELS = {
    "Qwen2.5-7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4),
    "Qwen2.5-32B": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8),
}
TENSOR_PARALLEL = {"Qwen2.5-7B": 1, "Qwen2.5-32B": 4}  # vLLM ranks per model copy
HOST_MEMORY = ("256GiB", "1TiB")
GB = 1e9
# An H100 80GB HBM3 as bench/RESULTS.md measured it ("One H100"): the memory layer's pinned
# backup paused at 0.93x and resumed at 0.89x of a raw pinned copy (53.7-55.0 GB/s) at
# 1024 MiB; the engines' in-place sync ran at 269.8 GB/s against a device memcpy's 980.6
# (its byte scale); the device's memory is what nvidia-smi shows for it (81559 MiB). Not
# measured there: a pause and a resume without backup (priced as a device copy of their
# bytes, more than unmapping and mapping them again costs) and a switch's fixed cost and
# cost per tensor (0: milliseconds beside the seconds these bytes take).
H100 = Rates(device="NVIDIA H100 80GB HBM3", backup_out=0.93 * 54.0 * GB,
             backup_in=0.89 * 54.0 * GB, drop=980.6 * GB, refill=980.6 * GB,
             in_slot=980.6 * GB, pinned_to_slot=54.0 * GB, slot_to_pinned=54.0 * GB,
             byte_scale={"in_place": 980.6 / 269.8}, slot_bytes=81559 << 20,
             host="assembled from bench/RESULTS.md's H100 figures, not calibrated there")


def model_config(name: str) -> transformers.PretrainedConfig:
    """`name`'s published config."""
    return transformers.Qwen2Config(**MODELS[name], vocab_size=152064,
                                    max_position_embeddings=32768, tie_word_embeddings=False)


def plan_row(name: str, host_memory: str, rates: Rates, beta: float = 0.0) -> dict[str, Any]:
    """The plan of `name`'s run on the node (see module), in the table's figures."""
    overrides = ["run.slots=8", "run.engine=vllm", "trainer.parallel=fsdp",
                 f"generator.tensor_parallel_size={TENSOR_PARALLEL[name]}",
                 f"generator.max_model_len={SEQUENCE}",
                 f"run.host_memory={host_memory}", f"grpo.beta={beta}"]
    plan = make_plan(load_config(overrides=overrides), model_config(name), rates).as_dict()
    slot = plan["slots"][0]
    figures = plan["predicted"]
    return {"model": name, "host_memory": host_memory, "reference": beta > 0,
            "tensor_parallel": TENSOR_PARALLEL[name], "fits": plan["fits"], "why": plan["why"],
            "stages_gb": {f"{tenant}/{stage}": figure["bytes"] / GB
                          for tenant, held in slot["tenants"].items()
                          for stage, figure in held["stages"].items()},
            "all_stages_gb": sum(figure["bytes"] for held in slot["tenants"].values()
                                 for figure in held["stages"].values()) / GB,
            "capacity_gb": slot["capacity_bytes"] / GB, "peak_slot_gb": slot["peak_bytes"] / GB,
            "moved_per_step_gb": figures["bytes_moved_per_step"] / GB,
            "switch_s": figures["switch_s_per_step"], "sync_s": figures["sync_s_per_step"],
            "peak_host_gb": figures["peak_host_bytes"] / GB,
            "switches": [(s["turn"], s["way"], s["seconds"], s["slept"], s["woken"])
                         for s in slot["step"]]}


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as docs/plan_anchors.md's table."""
    lines = ["| model (vLLM TP) | reference | host memory | per GPU: trainer weights / "
             "AdamW / grads, vLLM weights / KV cache (GB) | all of them (GB) | peak after "
             "a switch (GB) | moved per step, node (GB) | switch + sync per step (s) | "
             "peak host (GB) | fits |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        s = r["stages_gb"]
        held = (f"{s['trainer/weights']:.1f} / {s['trainer/optimizer']:.1f} / "
                f"{s['trainer/grads']:.1f}, {s['generator/weights']:.1f} / "
                f"{s['generator/kv_cache']:.1f}")
        if r["reference"]:
            held += f", reference {s['reference/weights']:.1f}"
        lines.append(f"| {r['model']} ({r['tensor_parallel']}) | "
                     f"{'yes' if r['reference'] else 'no'} | {r['host_memory']} | {held} | "
                     f"{r['all_stages_gb']:.1f} | {r['peak_slot_gb']:.1f} | "
                     f"{r['moved_per_step_gb']:.1f} | "
                     f"{r['switch_s']:.2f} + {r['sync_s']:.2f} | {r['peak_host_gb']:.0f} | "
                     f"{'yes' if r['fits'] else 'no (below)'} |")
    refused = [f"- {r['model']}, host {r['host_memory']}, reference {r['reference']}: "
               f"{r['why']}" for r in rows if not r["fits"]]
    return "\n".join(lines + ([""] + refused if refused else []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=Path, default=None,
                        help="a rates file measured on the GPU (default: H100, assembled)")
    parser.add_argument("--out", type=Path, default=None, help="the rows as JSON")
    args = parser.parse_args()
    rates = load_rates(args.rates) if args.rates else H100
    rows = [plan_row(name, host, rates, beta) for name in MODELS for beta in (0.0, 0.04)
            for host in HOST_MEMORY]
    print(f"rates: {rates.device} ({rates.host or 'calibrated'})")
    print(markdown(rows))
    for row in rows:
        print(f"\n{row['model']}, reference {row['reference']}, host {row['host_memory']}:")
        for turn, way, seconds, slept, woken in row["switches"]:
            print(f"  {turn} ({way}, {seconds:.2f} s): slept {slept}; woken {woken}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
