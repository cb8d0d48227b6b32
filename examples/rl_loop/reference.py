"""The reference model, a third tenant (`grpo.beta > 0`), and what it costs per proc.

The reference (the starting weights, frozen: `ReferenceActor`) is spawned in the trainer's
resource group, on the trainer's procs and laid out like it (DDP: whole on each rank; FSDP:
sharded the same way). Each step it is woken for the reference log-probabilities of the
step's completions, between generation and training, and sleeps otherwise: the arbiters
take the three tenants in turn (`memory.ProcPeaks` checks what that costs per proc).
"""

from __future__ import annotations

from typing import Any

from colocate.engines.actors import ReferenceActor
from examples.rl_loop.config import RLConfig
from services import Service, ServiceConfig, spawn_service


async def spawn_reference(cfg: RLConfig, model_dir: str, group: str,
                          restart: dict[str, Any]) -> Service:
    """The reference service: one replica over the trainer's procs, in its group, with its
    restart policy (a restarted group brings the reference back with the same weights)."""
    return await spawn_service(
        ServiceConfig(hosts_per_replica=cfg.run.hosts, procs_per_host=cfg.run.slots,
                      resource_group=group, **restart),
        ReferenceActor, model_dir, name="reference", parallel=cfg.trainer.parallel,
        mixed_precision=cfg.trainer.mixed_precision)
