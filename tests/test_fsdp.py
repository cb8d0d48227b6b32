"""The FSDP2 trainer on 2 CPU procs over gloo, in plain processes: the same losses as one
proc training on the same global batch, and each proc's shard under the trainer's tags (a
sleep gives it back, a wake restores it bit-identical, training goes on as if uninterrupted).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from colocate import telemetry
from colocate.engines.fsdp_gather import gather_full
from colocate.engines.models import load_model
from colocate.engines.tiny import write_tiny_model
from colocate.engines.trainer import PolicyTrainer
from colocate.engines.weights import digest

WORLD = 2
STEPS = 3
# How far 3 bf16 steps drift from fp32's losses: within 2% where the CPU computes bf16
# natively (AVX512: measured in earlier sessions); the AVX2 kernels round bf16 through
# fp32 differently and the trajectory drifts further (measured 2.55% at step 3 on an
# AMD EPYC, 2026-11-25), still bf16's precision compounded over three updates.
BF16_TRAJECTORY_REL = 2e-2 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") \
    else 3e-2
# 1-proc losses vs the mean of 2 ranks' losses: the same sums in another order (gloo's
# reduction of gradients, then AdamW), so equal to float32 rounding, not bit for bit
TOLERANCE = 1e-5


def ce_loss(module, batch):
    logits = module(input_ids=batch).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                             batch[:, 1:].flatten()), {}


def global_batch() -> torch.Tensor:
    """The batch every step trains on (so the loss visibly falls)."""
    return torch.randint(3, 16, (4, 12), generator=torch.Generator().manual_seed(0))


def fsdp_rank(rank: int, port: int, path: str, out: str) -> None:
    """One rank: an FSDP trainer that sleeps and wakes between steps, and a twin that
    does not; each trains on rows rank, rank + WORLD, ... of every global batch."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    slept = PolicyTrainer(load_model(path), prefix="slept", parallel="fsdp", bucket_mb=1)
    twin = PolicyTrainer(load_model(path), prefix="twin", parallel="fsdp")
    mixed = PolicyTrainer(load_model(path), prefix="mixed", parallel="fsdp",
                          mixed_precision=True, activation_checkpointing=True)
    rows = slice(rank, None, WORLD)
    losses, twin_losses, mixed_losses, cycles = [], [], [], []
    for _ in range(STEPS):
        batch = global_batch()[rows]
        losses.append(slept.step(ce_loss, batch)["loss"])
        twin_losses.append(twin.step(ce_loss, batch)["loss"])
        mixed_losses.append(mixed.step(ce_loss, batch)["loss"])
        shard = digest((n, p.to_local()) for n, p in slept.model.named_parameters())
        info = slept.tenancy.describe()
        before = telemetry.process_rss()
        released = slept.tenancy.sleep()
        asleep = telemetry.process_rss()
        slept.tenancy.wake(list(slept.tenancy.stages))
        cycles.append({
            "tagged": info.tagged_bytes, "released": released, "rss_drop": before - asleep,
            "restored": digest((n, p.to_local()) for n, p in slept.model.named_parameters())
            == shard})
    full = dict(slept.weights().tensors())  # every rank takes part in the gathers
    by_dtensor = digest((n, t.full_tensor()) for n, t in slept.model.state_dict().items())
    buffers = [len({t.untyped_storage().data_ptr() for _, t in bucket})
               for bucket in PolicyTrainer.weights(slept).buckets()]
    mesh = init_device_mesh("cpu", (WORLD,))
    edges = [distribute_tensor(torch.arange(rows * 3.0).view(rows, 3), mesh, [Shard(0)])
             for rows in (1, 3, 5, 8)]  # 1 row: rank 1's shard is empty
    edges_equal = all(torch.equal(mine, theirs.full_tensor())
                      for mine, theirs in zip(gather_full(edges), edges, strict=True))
    local = sum(p.to_local().numel() * 4 for p in slept.model.parameters())
    Path(out, f"{rank}.json").write_text(json.dumps({
        "losses": losses, "twin_losses": twin_losses, "cycles": cycles,
        "mixed_losses": mixed_losses,
        "mixed_dtypes": sorted({str(p.dtype) for p in mixed.model.parameters()}),
        "local_weight_bytes": local, "digest": digest(full.items()),
        "full_tensor_digest": by_dtensor, "buffers_per_bucket": buffers,
        "edges_equal": edges_equal}))


def one_proc_reference(path: str) -> tuple[list[float], str]:
    trainer = PolicyTrainer(load_model(path), prefix="reference")
    losses = [trainer.step(ce_loss, global_batch())["loss"] for step in range(STEPS)]
    return losses, digest(trainer.weights().tensors())


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("fsdp")
    path = str(write_tiny_model(root / "model", "qwen2", alphabet="0123456789+=>#",
                                hidden_size=256, layers=4, heads=4, kv_heads=2,
                                intermediate_size=1024, tie_embeddings=True, init_std=0.1))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=fsdp_rank, args=(rank, port, path, str(root)))
             for rank in range(WORLD)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=300)
    assert [proc.exitcode for proc in procs] == [0] * WORLD, "an FSDP rank failed"
    ranks = [json.loads((root / f"{rank}.json").read_text()) for rank in range(WORLD)]
    full_bytes = sum(p.numel() * 4 for p in load_model(path).parameters())
    return {"ranks": ranks, "reference": one_proc_reference(path), "full_bytes": full_bytes}


@pytest.mark.timeout(600)
def test_fsdp_on_two_procs_trains_as_one_proc_on_the_global_batch(fsdp_run):
    reference_losses, reference_digest = fsdp_run["reference"]
    ranks = fsdp_run["ranks"]
    mean = [sum(r["losses"][i] for r in ranks) / WORLD for i in range(STEPS)]
    assert mean == pytest.approx(reference_losses, rel=TOLERANCE)
    assert mean[-1] < mean[0]
    assert ranks[0]["digest"] == ranks[1]["digest"]  # both gathered the same full weights


@pytest.mark.timeout(600)
def test_fsdp_weights_gather_each_bucket_into_one_buffer_exactly(fsdp_run):
    """The bucketed gather (one buffer per bucket, shards gathered into it in place) gives
    exactly DTensor.full_tensor()'s weights, in several buckets (bucket_mb=1), including
    a tensor whose first dim does not divide by the world (the embeddings' 17 rows), and
    DTensors of 1, 3, 5 and 8 rows."""
    for rank in fsdp_run["ranks"]:
        assert rank["digest"] == rank["full_tensor_digest"]
        assert rank["edges_equal"]
        assert len(rank["buffers_per_bucket"]) > 4
        assert rank["buffers_per_bucket"] == [1] * len(rank["buffers_per_bucket"])


@pytest.mark.timeout(600)
def test_each_fsdp_shard_sleeps_and_wakes_and_training_goes_on_identically(fsdp_run):
    for rank in fsdp_run["ranks"]:
        # each rank holds its half of the parameters (FSDP pads the odd ones)
        assert rank["local_weight_bytes"] <= 0.55 * fsdp_run["full_bytes"]
        for cycle in rank["cycles"]:
            # weights + grads + two AdamW moments of the shard: all of it released
            assert cycle["tagged"] >= 4 * rank["local_weight_bytes"]
            assert cycle["released"] >= 0.99 * cycle["tagged"]
            assert cycle["rss_drop"] >= 0.9 * cycle["released"]
            assert cycle["restored"]
        assert rank["losses"] == rank["twin_losses"]  # bit for bit


@pytest.mark.timeout(600)
def test_fsdp_in_bf16_with_activation_checkpointing_trains_like_fp32(fsdp_run):
    """bf16 compute (fp32 sharded parameters and gradient reduction), activations
    recomputed in the backward pass: the losses of fp32 training, to bf16's precision."""
    reference_losses, _ = fsdp_run["reference"]
    ranks = fsdp_run["ranks"]
    mean = [sum(r["mixed_losses"][i] for r in ranks) / WORLD for i in range(STEPS)]
    assert mean == pytest.approx(reference_losses, rel=BF16_TRAJECTORY_REL)
    assert mean[-1] < mean[0]
    assert all(r["mixed_dtypes"] == ["torch.float32"] for r in ranks)
