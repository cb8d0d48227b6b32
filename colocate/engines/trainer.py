"""The trainer helper: a causal LM, its gradients and AdamW state, all under memory tags.

Three stages: "weights" (parameters, kept across sleeps), "optimizer" (AdamW moments,
kept) and "grads" (discarded: every step zeroes them first). Gradients and optimizer state
come into being at the first step and are adopted by their tags then.

When the proc was set up for torch.distributed (`services.distributed.setup_distributed`
sets WORLD_SIZE...), the model trains over gloo (CPU) or NCCL (GPU), as `parallel` says:

- "ddp": DistributedDataParallel; every rank holds the whole model; gradients are views
  of DDP's buckets, so the buckets sleep with the "grads" stage.
- "fsdp": FSDP2, `fully_shard` on each decoder layer, then on the root; each rank holds
  its shard of the parameters, gradients and AdamW state (DTensors), and its tags hold
  exactly that shard. `mixed_precision=True` computes in bf16 with fp32 gradient
  reduction (`MixedPrecisionPolicy`); the sharded parameters stay fp32.

`activation_checkpointing=True` recomputes each decoder layer's activations in the backward
pass (transformers' gradient checkpointing). `weights()` gives the full weights by Hugging
Face name as a `WeightStream`: from an FSDP trainer, every rank must iterate it together
(each bucket is an all-gather).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from colocate import memory
from colocate.arbiter.tenant import TaggedTenant
from colocate.engines.batches import to_device
from colocate.engines.checkpoint import Checkpointer
from colocate.engines.fsdp_gather import BucketGather, buffer_bytes
from colocate.engines.parallel import check_layout, distributed_env, join_group, shard
from colocate.engines.weights import WeightStream, publish

STAGES = {"weights": True, "optimizer": True, "grads": False}  # stage -> kept across a sleep
# default bound on the full tensors gathered at once from an FSDP trainer: 64 MiB, not 256,
# since each pass makes its gather buffer anew (a sleeping trainer keeps none) and at 256
# MiB zeroing that new memory bounds a gloo pass (bench/fsdp_sync.py: 3.6-4.8x the per-tensor
# way at 64 MiB, 1.7-2.1x at 256); it also lowers a sync's peak (bucket + largest tensor)
BUCKET_MB = 64

LossFn = Callable[[torch.nn.Module, Any], tuple[torch.Tensor, dict[str, float]]]


class NonFiniteGradientsError(RuntimeError):
    """A step's gradients were not finite (a diverging run, or a loss of inf or NaN): the
    optimizer step was skipped, so the weights and AdamW state are those from before it."""


class PolicyTrainer:
    """Trains `model` (a transformers causal LM) with AdamW; its memory is tagged under
    `prefix`, one tag per stage of `STAGES`: `tenancy` sleeps, wakes and describes it."""

    def __init__(self, model: torch.nn.Module, lr: float = 1e-3, weight_decay: float = 0.0,
                 max_grad_norm: float | None = 1.0, prefix: str = "trainer",
                 device: str | torch.device | None = None, parallel: str = "ddp",
                 mixed_precision: bool = False, activation_checkpointing: bool = False,
                 bucket_mb: int = BUCKET_MB) -> None:
        if lr <= 0:
            raise ValueError(f"lr={lr}: must be > 0")
        check_layout(parallel, mixed_precision, " (or autocast inside your loss_fn)")
        if bucket_mb < 1:
            raise ValueError(f"bucket_mb={bucket_mb}: must be >= 1")
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tenancy = TaggedTenant({s: f"{prefix}/{s}" for s in STAGES}, backup=STAGES)
        self.model = model.to(device).train()
        if activation_checkpointing:
            self.model.gradient_checkpointing_enable({"use_reentrant": False})
        self.parallel = parallel if distributed_env() else "none"
        self.module: torch.nn.Module = self.model
        if self.parallel != "none":
            join_group(device, "trainer")
        if self.parallel == "fsdp":
            shard(self.model, mixed_precision)
        self.tenancy.adopt(self.model, "weights")
        if self.parallel == "ddp":
            self.module = DistributedDataParallel(self.model, gradient_as_bucket_view=True)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr,
                                           weight_decay=weight_decay)
        self.max_grad_norm, self.device, self.steps = max_grad_norm, device, 0
        self.bucket_bytes = bucket_mb << 20
        self.checkpoints = Checkpointer()
        # until the first step makes them, its gradients and AdamW state (each moment as
        # large as the weights, and a float32 step count per parameter) are working memory
        # that a budget must keep free for it
        local = [p.to_local() if isinstance(p, DTensor) else p for p in self.model.parameters()]
        grads = sum(p.numel() * p.element_size() for p in local)
        self.optimizer_bytes = 2 * grads + 4 * len(local)
        self.tenancy.working_bytes = grads + self.optimizer_bytes
        publish(prefix, self.weights)

    @property
    def rank(self) -> int:
        return dist.get_rank() if self.parallel != "none" else 0

    @property
    def sharded(self) -> bool:
        """Whether full weights need every rank (an all-gather per bucket)."""
        return self.parallel == "fsdp"

    def step(self, loss_fn: LossFn, batch: Any) -> dict[str, float]:
        """One optimizer step on `loss_fn(module, batch)` -> (loss, metrics); returns the
        metrics with "loss" and "grad_norm" added. The batch's tensors are moved to the
        trainer's device first. Data-parallel ranks average gradients. Gradients that are
        not finite raise `NonFiniteGradientsError` before the optimizer step (every rank
        alike: the norm is of the averaged gradients), so NaN never reaches the weights."""
        self.tenancy.ensure_awake()
        self.optimizer.zero_grad(set_to_none=False)
        loss, metrics = loss_fn(self.module, to_device(batch, self.device))
        loss.backward()
        # the gradients tagged now, and room for AdamW's state checked before it is made:
        # a slot too full fails the step here (SlotOutOfMemoryError), with the weights as
        # they were, so the step can be tried again once room is made
        self.tenancy.adopt([p.grad for p in self.model.parameters() if p.grad is not None],
                           "grads")
        if self.tenancy.working_bytes:
            memory.ensure_room(self.optimizer_bytes, "the trainer's AdamW state")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                              self.max_grad_norm or float("inf"))
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        grad_norm = norm.item()
        if not math.isfinite(grad_norm):
            raise NonFiniteGradientsError(
                f"trainer step {self.steps}: gradient norm {grad_norm} (loss "
                f"{loss.item()}): not finite, so the optimizer step was skipped and the "
                "weights are still those from before it. The run diverged: lower the "
                "learning rate (lr), or look for inf or NaN in the loss's inputs "
                "(rewards, advantages, a KL term).")
        self.optimizer.step()
        self.tenancy.adopt(self.optimizer, "optimizer")
        self.tenancy.working_bytes = 0  # its state has stages of its own now
        self.steps += 1
        return {**metrics, "loss": loss.item(), "grad_norm": grad_norm}

    def save_checkpoint(self, path: str | os.PathLike, wait: bool = True, *,
                        frame_dir: str | os.PathLike | None = None) -> None:
        """Save parameters, AdamW state, `steps` and the RNG states into directory `path`
        (`colocate.engines.checkpoint`); call it on every rank. With `wait=False` it
        returns once the state is staged (copied in host memory) and writes in the
        background: `wait_checkpoint()` gives the outcome. `frame_dir`: the model
        directory whose config and tokenizer files go into `path/hf` (without it, the
        model's config alone). The trainer must be awake (`TagPausedError` otherwise)."""
        self.checkpoints.save(self, path, wait=wait, frame_dir=frame_dir)

    def wait_checkpoint(self) -> str | None:
        """Wait for the save in flight; its final path, or None when none was in flight.
        A failed write raises `CheckpointError` here, naming the path."""
        return self.checkpoints.wait()

    def poll_checkpoint(self) -> str | None:
        """The save in flight, without waiting: "writing", "written" (ended, well or not:
        `wait_checkpoint` says which), or None when none is in flight."""
        return self.checkpoints.poll()

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Load parameters, AdamW state, `steps` and RNG states from `path` (saved by any
        world size and parallel: DCP reshards); call it on every rank. Raises a
        `CheckpointError` and leaves the trainer as it was when `path` cannot be used."""
        self.checkpoints.load(self, path)
        if self.optimizer.state:  # its AdamW state came with it, under a stage of its own
            self.tenancy.working_bytes = 0

    def weights(self) -> WeightStream:
        """The full weights by Hugging Face name, in buckets of at most `bucket_mb` (or one
        tensor, when it is larger). From an FSDP trainer every rank iterates it together."""
        self.tenancy.ensure_stage("weights")
        state = self.model.state_dict()
        specs = {name: (tuple(t.shape), t.dtype) for name, t in state.items()}
        return WeightStream(specs, lambda: self._buckets(state))

    def _buckets(self, state: dict[str, torch.Tensor]
                 ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        buckets = cut_buckets(state, self.bucket_bytes)
        capacity = max((buffer_bytes([t for _, t in bucket]) for bucket in buckets), default=0)
        # one shared buffer for the pass (on one host), made once at its largest bucket
        with BucketGather(capacity) as gather:
            for bucket in buckets:
                yield _gathered(gather, bucket)


def cut_buckets(state: dict[str, torch.Tensor], bucket_bytes: int
                ) -> list[list[tuple[str, torch.Tensor]]]:
    """`state`'s (name, tensor) pairs in order, cut into buckets of at most `bucket_bytes`
    of full tensors (or one tensor, when it is larger)."""
    buckets: list[list[tuple[str, torch.Tensor]]] = []
    bucket, size = [], 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            buckets.append(bucket)
            bucket, size = [], 0
        bucket.append((name, tensor.detach()))
        size += nbytes
    return buckets + [bucket] if bucket else buckets


def _gathered(gather: BucketGather, bucket: list[tuple[str, torch.Tensor]]
              ) -> list[tuple[str, torch.Tensor]]:
    """`bucket` with its FSDP shards gathered into full tensors (one buffer per bucket)."""
    names = [name for name, _ in bucket]
    return list(zip(names, gather([tensor for _, tensor in bucket]), strict=True))
