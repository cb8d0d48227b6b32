"""The FSDP2 trainer on every GPU present (2 to 8, NCCL), in plain processes: each rank's
shard of parameters, gradients and AdamW state sleeps under torch_memory_saver (this
process's NVML share falls by >= 0.99 of its tagged bytes), wakes bit-identical, and
training goes on exactly as an uninterrupted twin's."""

from __future__ import annotations

import multiprocessing
import os
import socket

import pytest
import torch

from colocate import memory, telemetry
from colocate.engines.trainer import PolicyTrainer
from colocate.engines.weights import digest

STEPS = 2


def _model() -> torch.nn.Module:
    """A random Qwen2 of about 100 M parameters with tied embeddings."""
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=64, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=64,
        tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _loss(module, batch):
    return module(input_ids=batch).logits[..., 5].mean(), {}


def _used() -> int:
    torch.cuda.synchronize()
    return telemetry.read_gpu_process(torch.cuda.current_device()).used_bytes


def fsdp_rank(rank: int, world: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    slept = PolicyTrainer(_model(), prefix="slept", parallel="fsdp")
    twin = PolicyTrainer(_model(), prefix="twin", parallel="fsdp")
    batch = torch.randint(3, 64, (2, 32), generator=torch.Generator().manual_seed(rank))
    batch = batch.cuda()
    out = {"losses": [], "twin": [], "cycles": []}
    for _ in range(STEPS):
        out["losses"].append(slept.step(_loss, batch)["loss"])
        out["twin"].append(twin.step(_loss, batch)["loss"])
        shard = digest((n, p.to_local()) for n, p in slept.model.named_parameters())
        tagged = slept.tenancy.describe().tagged_bytes
        memory.release_cached()
        before = _used()
        slept.tenancy.sleep()
        asleep = _used()
        slept.tenancy.wake(list(slept.tenancy.stages))
        out["cycles"].append({
            "tagged": tagged, "released": before - asleep,
            "restored": digest((n, p.to_local()) for n, p in slept.model.named_parameters())
            == shard})
    out["after"] = slept.step(_loss, batch)["loss"] == twin.step(_loss, batch)["loss"]
    queue.put((rank, out))


def test_each_fsdp_shard_sleeps_and_wakes_on_its_gpu():
    world = min(torch.cuda.device_count(), 8)
    if world < 2:
        pytest.skip("FSDP over NCCL needs 2 GPUs or more")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    procs = [context.Process(target=fsdp_rank, args=(rank, world, port, queue))
             for rank in range(world)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=600) for _ in range(world))
    for proc in procs:
        proc.join(timeout=60)
    assert [proc.exitcode for proc in procs] == [0] * world
    for rank in range(world):
        out = results[rank]
        assert out["losses"] == out["twin"] and out["after"]
        for cycle in out["cycles"]:
            assert cycle["released"] >= 0.99 * cycle["tagged"], (rank, cycle)
            assert cycle["restored"]
