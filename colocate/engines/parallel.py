"""How an engine joins its replica's torch.distributed group and shards a model (FSDP2).

The trainer and the reference policy of a resource group share each proc's process, so
they share its default process group: the first to start makes it (from the variables
`services.distributed.setup_distributed` set), the next checks it and uses it.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from colocate.engines.models import decoder_layers

PARALLEL = ("ddp", "fsdp")


def check_layout(parallel: str, mixed_precision: bool, hint: str = "") -> None:
    """Refuse a `parallel` not in PARALLEL, or `mixed_precision` without FSDP (`hint`: what
    else the caller may do, appended to that message)."""
    if parallel not in PARALLEL:
        raise ValueError(f"parallel={parallel!r}: use one of {PARALLEL}")
    if mixed_precision and parallel != "fsdp":
        raise ValueError("mixed_precision=True is FSDP's MixedPrecisionPolicy: use "
                         f"parallel='fsdp'{hint}")


def distributed_env() -> bool:
    """Whether this proc belongs to a replica of several procs (WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def join_group(device: torch.device, who: str) -> None:
    """This replica's torch.distributed group: made here, or checked when it exists. On
    CUDA each rank takes the GPU of its LOCAL_RANK among those it sees (a slot proc sees
    one). `who` names the engine in the error."""
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    elif dist.get_world_size() != int(os.environ["WORLD_SIZE"]):
        raise RuntimeError(
            f"this process is already in a torch.distributed group of "
            f"{dist.get_world_size()} rank(s), not this replica's WORLD_SIZE "
            f"{os.environ['WORLD_SIZE']} (a vLLM generator on the same proc starts "
            f"its own); give the {who} procs without it, or one proc")


def shard(model: torch.nn.Module, mixed_precision: bool) -> None:
    """FSDP2: each decoder layer its own unit, then the root (embeddings, norm, head);
    `mixed_precision`: bf16 compute, fp32 gradient reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mixed_precision else MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
