"""The trainer helper: a policy, its gradients and AdamW state, all under memory tags.

Three stages: "weights" (parameters, kept across sleeps), "optimizer" (AdamW moments,
kept) and "grads" (discarded: every step zeroes them first). Gradients and optimizer state
come into being at the first step and are adopted by their tags then. When the proc was
set up for torch.distributed (`services.distributed.setup_distributed` sets WORLD_SIZE...),
the model trains data-parallel with DDP over gloo (CPU) or NCCL (GPU); gradients are views
of DDP's buckets, so the buckets sleep with the "grads" stage.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from colocate.arbiter.tenant import TaggedTenant, TenantInfo
from colocate.engines.llama import Llama
from colocate.engines.weights import publish

STAGES = {"weights": True, "optimizer": True, "grads": False}  # stage -> kept across a sleep

LossFn = Callable[[torch.nn.Module, Any], tuple[torch.Tensor, dict[str, float]]]


class PolicyTrainer:
    """Trains `model` with AdamW; its memory is tagged under `prefix`."""

    def __init__(self, model: Llama, lr: float = 1e-3, weight_decay: float = 0.0,
                 max_grad_norm: float | None = 1.0, prefix: str = "trainer",
                 device: str | torch.device | None = None) -> None:
        if lr <= 0:
            raise ValueError(f"lr={lr}: must be > 0")
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tenancy = TaggedTenant({s: f"{prefix}/{s}" for s in STAGES}, backup=STAGES)
        self.model = model.to(device).train()
        self.tenancy.adopt(self.model, "weights")
        self.module: torch.nn.Module = self.model
        if _distributed_env():
            if not dist.is_initialized():
                dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
            elif dist.get_world_size() != int(os.environ["WORLD_SIZE"]):
                raise RuntimeError(
                    f"this process is already in a torch.distributed group of "
                    f"{dist.get_world_size()} rank(s), not this replica's WORLD_SIZE "
                    f"{os.environ['WORLD_SIZE']} (a vLLM generator on the same proc starts "
                    "its own); give the trainer procs without it, or one proc")
            self.module = DistributedDataParallel(self.model, gradient_as_bucket_view=True)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr,
                                           weight_decay=weight_decay)
        self.max_grad_norm, self.device, self.steps = max_grad_norm, device, 0
        publish(prefix, self.named_weights)

    def sleep(self, stages: list[str] | None = None) -> int:
        return self.tenancy.sleep(stages)

    def wake(self, stages: list[str]) -> None:
        self.tenancy.wake(stages)

    def describe(self) -> TenantInfo:
        return self.tenancy.describe()

    def step(self, loss_fn: LossFn, batch: Any) -> dict[str, float]:
        """One optimizer step on `loss_fn(module, batch)` -> (loss, metrics); returns the
        metrics with "loss" and "grad_norm" added. Data-parallel ranks average gradients."""
        self.tenancy.ensure_awake()
        self.optimizer.zero_grad(set_to_none=False)
        loss, metrics = loss_fn(self.module, batch)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                              self.max_grad_norm or float("inf"))
        self.optimizer.step()
        self.tenancy.adopt([p.grad for p in self.model.parameters() if p.grad is not None],
                           "grads")
        self.tenancy.adopt(self.optimizer, "optimizer")
        self.steps += 1
        return {**metrics, "loss": loss.item(), "grad_norm": norm.item()}

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The policy's tensors by Hugging Face name (what generators load)."""
        self.tenancy.ensure_stage("weights")
        return self.model.state_dict().items()


def _distributed_env() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1
