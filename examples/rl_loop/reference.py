"""The reference model, a third tenant (`grpo.beta > 0`), and what it costs per proc.

The reference (the starting weights, frozen: `ReferenceActor`) is spawned in the trainer's
resource group, on the trainer's procs and laid out like it (DDP: whole on each rank; FSDP:
sharded the same way). Each step it is woken for the reference log-probabilities of the
step's completions, between generation and training, and sleeps otherwise: the arbiters
take the three tenants in turn.

`ProcPeaks` keeps, per proc, the most each tenant held at a phase switch and the most all
of them held together; its summary says whether the proc's peak stayed within
max(trainer, generator) + the reference's weights (the readings are taken once each switch
is done; the arbiter has verified each release before the next wake).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from colocate.engines.actors import ReferenceActor
from examples.rl_loop.config import RLConfig
from services import Service, ServiceConfig, spawn_service


async def spawn_reference(cfg: RLConfig, model_dir: str, group: str,
                          restart: dict[str, Any]) -> Service:
    """The reference service: one replica over the trainer's procs, in its group, with its
    restart policy (a restarted group brings the reference back with the same weights)."""
    return await spawn_service(
        ServiceConfig(procs_per_host=cfg.run.slots, resource_group=group, **restart),
        ReferenceActor, model_dir, name="reference", parallel=cfg.trainer.parallel,
        mixed_precision=cfg.trainer.mixed_precision)


class ProcPeaks:
    """Per proc (pid): the most each tenant held at a reading, and the most all held at
    once."""

    def __init__(self) -> None:
        self.tenant: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.together: dict[int, int] = defaultdict(int)

    def add(self, readings: dict[str, dict[int, int]]) -> None:
        """One moment's readings: tenant -> pid -> resident bytes."""
        now: dict[int, int] = defaultdict(int)
        for name, per_proc in readings.items():
            for pid, held in per_proc.items():
                self.tenant[name][pid] = max(self.tenant[name][pid], held)
                now[pid] += held
        for pid, held in now.items():
            self.together[pid] = max(self.together[pid], held)

    def summary(self) -> dict[str, Any]:
        """The worst proc's peak against its bound, max(trainer, generator) + reference."""
        rows = []
        for pid, peak in self.together.items():
            bound = max(self.tenant["trainer"][pid], self.tenant["generator"][pid]) \
                + self.tenant["reference"][pid]
            rows.append({"peak_bytes": peak, "bound_bytes": bound,
                         "reference_bytes": self.tenant["reference"][pid]})
        worst = max(rows, key=lambda r: r["peak_bytes"] / max(r["bound_bytes"], 1))
        return {**worst, "within_bound": all(r["peak_bytes"] <= r["bound_bytes"]
                                              for r in rows), "procs": len(rows)}
