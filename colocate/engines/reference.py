"""The reference policy: a frozen copy of the starting weights, a tenant that keeps only them.

GRPO's KL term compares the policy with where it started. `ReferencePolicy` holds that
model under one memory tag ("weights", kept across sleeps), computes nothing but forward
passes under `torch.no_grad()`, and so is a third tenant that fits beside a trainer and a
generator: it is woken for a step's reference log-probabilities and sleeps otherwise.

On several procs it is laid out like the trainer it sits beside: "ddp", each rank holds the
whole model; "fsdp", each rank its shard (FSDP2, the same units as the trainer), the full
layers gathered during the forward pass. It joins the proc's default process group (the
trainer's, when that started first), so every rank calls `forward` together, each on its
own rows (see `examples.rl_loop.rollouts.ReferenceLogprobs`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from colocate.arbiter.tenant import TaggedTenant
from colocate.engines.batches import to_device
from colocate.engines.parallel import check_layout, distributed_env, join_group, shard
from colocate.engines.weights import digest

STAGES = {"weights": True}  # stage -> kept across a sleep

ForwardFn = Callable[[torch.nn.Module, Any], Any]


class ReferencePolicy:
    """`model` frozen (no gradients, eval mode) under the memory tag `prefix/weights`;
    `tenancy` sleeps, wakes and describes it."""

    def __init__(self, model: torch.nn.Module, prefix: str = "reference",
                 device: str | torch.device | None = None, parallel: str = "ddp",
                 mixed_precision: bool = False) -> None:
        check_layout(parallel, mixed_precision)
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tenancy = TaggedTenant({s: f"{prefix}/{s}" for s in STAGES}, backup=STAGES)
        self.device = device
        self.model = model.to(device).eval().requires_grad_(False)
        self.parallel = parallel if distributed_env() else "none"
        if self.parallel != "none":
            join_group(device, "reference")
        if self.parallel == "fsdp":
            shard(self.model, mixed_precision)
        self.tenancy.adopt(self.model, "weights")

    def forward(self, fn: ForwardFn, batch: Any) -> Any:
        """`fn(model, batch)` under `torch.no_grad()`, with the batch's tensors on the
        model's device and the result's on CPU: the model must be awake."""
        self.tenancy.ensure_awake()
        with torch.no_grad():
            return to_device(fn(self.model, to_device(batch, self.device)), "cpu")

    def checksum(self) -> str:
        """A digest of the weights this rank keeps (its shard under FSDP): equal before
        and after a sleep when the contents were kept."""
        self.tenancy.ensure_stage("weights")
        return digest((name, t.to_local() if isinstance(t, DTensor) else t)
                      for name, t in self.model.state_dict().items())
