"""What a run leaves behind: per-step metrics, memory per tenant over time, and the plots
(`reward.png`, `memory.png`) and `metrics.json` written from them."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


@dataclass
class RunRecord:
    """Metrics per step, memory readings per tenant, and the phase switches, in time."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)  # t, tenant, bytes
    phases: list[tuple[float, str]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)  # the resolved configuration
    start: float = field(default_factory=time.monotonic)

    def now(self) -> float:
        return time.monotonic() - self.start

    def phase(self, label: str) -> None:
        self.phases.append((self.now(), label))

    def reading(self, tenant: str, resident_bytes: int) -> None:
        self.memory.append({"t": self.now(), "tenant": tenant, "bytes": resident_bytes})

    def write(self, out: Path, summary: dict[str, Any]) -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps(
            {"config": self.config, "summary": summary, "steps": self.steps,
             "memory": self.memory, "phases": self.phases}, indent=2))
        self._plot_reward(out / "reward.png")
        self._plot_memory(out / "memory.png")

    def _plot_reward(self, path: Path) -> None:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([s["step"] for s in self.steps], [s["reward"] for s in self.steps],
                label="train reward (mean over rollouts)")
        evals = [s for s in self.steps if "eval_reward" in s]
        ax.plot([s["step"] for s in evals], [s["eval_reward"] for s in evals], "o-",
                label="eval reward (greedy, held-out)")
        ax.set(xlabel="step", ylabel="reward", ylim=(0, 1), title="GRPO on the toy task")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)

    def _plot_memory(self, path: Path) -> None:
        """The whole run, and (once there are three) the last three steps up close, where
        each switch can be seen."""
        starts = [t for t, label in self.phases if label == "generate"]
        zoom = starts[-3] if len(starts) >= 3 else None
        fig, axes = plt.subplots(1 if zoom is None else 2, 1, figsize=(9, 7 if zoom else 4),
                                 squeeze=False)
        self._memory_panel(axes[0][0], "memory per tenant; grey lines: phase switches", 0.0)
        if zoom is not None:
            self._memory_panel(axes[1][0], "the last three steps", zoom)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)

    def _memory_panel(self, ax: Any, title: str, since: float) -> None:
        """Memory per tenant from `since` on (with the reading in force then)."""
        for tenant in sorted({r["tenant"] for r in self.memory}):
            rows = [r for r in self.memory if r["tenant"] == tenant]
            before = [r for r in rows if r["t"] < since][-1:]
            rows = [*({**r, "t": since} for r in before), *(r for r in rows if r["t"] >= since)]
            ax.step([r["t"] for r in rows], [r["bytes"] / 2**20 for r in rows], where="post",
                    label=tenant)
        phases = [(t, label) for t, label in self.phases if t >= since]
        for t, label in phases:
            ax.axvline(t, color="grey", lw=0.5, alpha=0.5)
            if len(phases) <= 12:
                ax.text(t, ax.get_ylim()[1], label, rotation=90, va="top", fontsize=7)
        ax.set(xlabel="seconds", ylabel="MiB held (tagged, resident)", title=title)
        ax.legend()
