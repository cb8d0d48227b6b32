"""What a run leaves behind: per-step metrics, memory per tenant over time, and the plots
(`reward.png`, `memory.png`) and `metrics.json` written from them. Steps and memory
readings also go, as they happen, to TensorBoard event files under `<out>/tensorboard`
(`tensorboard --logdir runs/rl_loop`), and with `run.wandb=true` to an offline Weights &
Biases run under `<out>/wandb` (`wandb sync <that run's directory>` uploads it)."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

if TYPE_CHECKING:
    from examples.rl_loop.state import LoopState

DETAILED_STEPS = 20  # up to this many steps memory.png draws every switch of the run
ENVELOPE_BINS = 200  # past them, the least and the most held in at most this many bins


@dataclass
class RunRecord:
    """Metrics per step, memory readings per tenant, and the phase switches, in time."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)  # t, tenant, bytes
    phases: list[tuple[float, str]] = field(default_factory=list)
    restarts: list[dict[str, Any]] = field(default_factory=list)  # after lost procs
    config: dict[str, Any] = field(default_factory=dict)  # the resolved configuration
    logdir: Path | None = None  # TensorBoard events go here when given
    wandb_dir: Path | None = None  # an offline W&B run goes here when given
    start: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.events = self.wandb = None
        if self.logdir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.events = SummaryWriter(str(self.logdir))
            self.events.add_text("config", f"```\n{json.dumps(self.config, indent=2)}\n```")
        if self.wandb_dir is not None:
            self.wandb = _offline_wandb(self.wandb_dir, self.config)

    def resume(self, state: LoopState) -> None:
        """Go on from a checkpoint: what it recorded and its clock."""
        self.memory, self.phases = list(state.memory), list(state.phases)
        self.restarts = list(state.restarts)
        self.start = time.monotonic() - state.elapsed_s
        self.rewind(state)

    def rewind(self, state: LoopState) -> None:
        """Back to a checkpoint's steps: those after it are dropped (they will be run
        again), and TensorBoard hides their events (a new writer with `purge_step`)."""
        self.steps = list(state.metrics)
        if self.events is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.events.close()
            self.events = SummaryWriter(str(self.logdir), purge_step=state.step)

    def restart(self, event: dict[str, Any]) -> None:
        """A restart of the run's slots after a lost proc (step, cause, seconds lost...)."""
        self.restarts.append(event)
        if self.events is not None:
            self.events.add_scalar("run/restarts", len(self.restarts), event["step"])
            self.events.add_text("run/restart", json.dumps(event), event["step"])

    def step(self, row: dict[str, Any]) -> None:
        """A step's metrics (step -1: the untrained evaluation)."""
        self.steps.append(row)
        if self.events is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, int | float):
                    self.events.add_scalar(f"rl/{key}", value, row["step"])
        if self.wandb is not None:
            self.wandb.log({f"rl/{key}": value for key, value in row.items()
                            if isinstance(value, int | float)})

    def now(self) -> float:
        return time.monotonic() - self.start

    def phase(self, label: str) -> None:
        self.phases.append((self.now(), label))

    def reading(self, tenant: str, resident_bytes: int, t: float | None = None) -> None:
        """What `tenant` holds at time `t` (default: now; the readings of one moment share
        their `t`, so the plot's total has no step between them)."""
        t = self.now() if t is None else t
        self.memory.append({"t": t, "tenant": tenant, "bytes": resident_bytes})
        if self.events is not None:
            self.events.add_scalar(f"memory_mib/{tenant}", resident_bytes / 2**20,
                                   len(self.memory))
        if self.wandb is not None:
            self.wandb.log({"memory/reading": len(self.memory), "memory/t": t,
                            f"memory_mib/{tenant}": resident_bytes / 2**20})

    def write(self, out: Path, summary: dict[str, Any]) -> None:
        out.mkdir(parents=True, exist_ok=True)
        if self.events is not None:
            self.events.flush()
        if self.wandb is not None:
            self.wandb.summary.update(summary)
            self.wandb.finish()
            self.wandb = None
        (out / "metrics.json").write_text(json.dumps(
            {"config": self.config, "summary": summary, "steps": self.steps,
             "restarts": self.restarts, "memory": self.memory, "phases": self.phases},
            indent=2))
        self._plot_reward(out / "reward.png")
        self._plot_memory(out / "memory.png")

    def _plot_reward(self, path: Path) -> None:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([s["step"] for s in self.steps], [s["reward"] for s in self.steps],
                label="train reward (mean over rollouts)")
        evals = [s for s in self.steps if "eval_reward" in s]
        ax.plot([s["step"] for s in evals], [s["eval_reward"] for s in evals], "o-",
                label="eval reward (greedy, held-out)")
        # a user's weighted reward functions may score outside [0, 1]
        seen = [v for s in self.steps for v in (s.get("reward"), s.get("eval_reward"))
                if isinstance(v, int | float)]
        ax.set(xlabel="step", ylabel="reward", title=self._title(),
               ylim=(min([0.0, *seen]), max([1.0, *seen])))
        ax.legend()
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)

    def _title(self) -> str:
        """The run in one line: model, steps, learning rate, engine, slots."""
        cfg = self.config
        if not cfg:
            return "GRPO on the toy task"
        model = cfg["model"]
        name = Path(model["path"]).name if model.get("path") else \
            f"tiny {model['architecture']} ({model['hidden_size']} wide, {model['layers']} layers)"
        run = cfg["run"]
        return (f"GRPO: {name}, {run['steps']} steps, lr {cfg['grpo']['lr']:g}, "
                f"{run['engine']} on {run['slots']} slot(s)"
                + (f" x {run['hosts']} hosts" if run.get("hosts", 1) > 1 else ""))

    def _plot_memory(self, path: Path) -> None:
        """The whole run, and (once there are three) the last three steps up close, where
        each switch can be seen. Past `DETAILED_STEPS` steps the whole run is drawn as an
        envelope (`_envelope_panel`): every switch of a long run would be a solid block."""
        starts = [t for t, label in self.phases if label == "generate"]
        zoom = starts[-3] if len(starts) >= 3 else None
        fig, axes = plt.subplots(1 if zoom is None else 2, 1, figsize=(9, 7 if zoom else 4),
                                 squeeze=False)
        if len(starts) > DETAILED_STEPS:
            self._envelope_panel(axes[0][0], starts)
        else:
            self._memory_panel(axes[0][0], "memory per tenant; grey lines: phase switches",
                               0.0)
        if zoom is not None:
            self._memory_panel(axes[1][0], "the last three steps", zoom)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)

    def _series(self, since: float) -> dict[str, list[tuple[float, float]]]:
        """Per slot, from `since` on (with the reading in force then): (t, MiB) of what each
        tenant holds, and of their total, the figure a GPU's memory must fit."""
        run = self.config.get("run", {})
        slots = run.get("slots", 1) * run.get("hosts", 1)
        tenants = sorted({r["tenant"] for r in self.memory})
        held = {tenant: 0.0 for tenant in tenants}
        series: dict[str, list[tuple[float, float]]] = {t: [] for t in [*tenants, "total"]}
        for reading in self.memory:
            held[reading["tenant"]] = reading["bytes"] / slots / 2**20
            t = max(reading["t"], since)
            for name, value in (*held.items(), ("total", sum(held.values()))):
                points = series[name]
                if points and points[-1][0] == t:  # the same moment: its last value holds
                    points.pop()
                points.append((t, value))
        return series

    def _memory_panel(self, ax: Any, title: str, since: float) -> None:
        """Every reading from `since` on, each phase switch a grey line."""
        for name, points in self._series(since).items():
            style = {"color": "black", "lw": 2, "alpha": 0.6} if name == "total" else {}
            ax.step([t for t, _ in points], [v for _, v in points], where="post",
                    label=name, **style)
        phases = [(t, label) for t, label in self.phases if t >= since]
        for t, label in phases:
            ax.axvline(t, color="grey", lw=0.5, alpha=0.5)
            if len(phases) <= 12:  # only where they do not overlap
                ax.annotate(label, (t, 1), xycoords=("data", "axes fraction"), rotation=90,
                            va="top", ha="right", fontsize=8,
                            bbox={"boxstyle": "round", "fc": "white", "ec": "none",
                                  "alpha": 0.8})
        ax.set_xlim(left=since)
        ax.set(xlabel="seconds since the run started", ylabel="MiB held per slot",
               title=title)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))

    def _envelope_panel(self, ax: Any, starts: list[float]) -> None:
        """The whole run by step: per tenant, the band from the least to the most it held
        during each step (over at most `ENVELOPE_BINS` bins of steps, so the panel has as
        many points at 2000 steps as at 200), the total's most as a line, and the run's
        peaks in a box."""
        envelopes = {name: _envelope(points, starts)
                     for name, points in self._series(0.0).items()}
        per_bin = -(-len(starts) // ENVELOPE_BINS)  # steps a bin, rounded up
        peaks = []
        for index, (name, (low, high)) in enumerate(envelopes.items()):
            edges = [min(i * per_bin, len(starts)) for i in range(len(high) + 1)]
            if name == "total":
                ax.step(edges, [*high, high[-1]], where="post", color="black", lw=1.5,
                        alpha=0.7, label="total (most in the step)")
            else:
                color = f"C{index}"
                ax.fill_between(edges, [*low, low[-1]], [*high, high[-1]], step="post",
                                color=color, alpha=0.35, lw=0, label=f"{name} (least..most)")
                ax.step(edges, [*high, high[-1]], where="post", color=color, lw=0.8)
            top = max(range(len(high)), key=high.__getitem__)
            last = min((top + 1) * per_bin, len(starts)) - 1
            where = f"step {last}" if per_bin == 1 else f"steps {top * per_bin}-{last}"
            peaks.append(f"{name}: {min(low):.3g} to {high[top]:.3g} MiB\n  (the most: {where})")
        ax.text(1.01, 0.0, f"the whole run, {len(starts)} steps:\n" + "\n".join(peaks),
                transform=ax.transAxes, fontsize=7, va="bottom", ha="left")
        ax.set_xlim(0, len(starts))
        ax.set_ylim(bottom=0)
        unit = "each step" if per_bin == 1 else f"each {per_bin} steps"
        ax.set(xlabel="step (in the order run)", ylabel="MiB held per slot",
               title=f"memory per tenant, the least and the most in {unit}")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)


def _envelope(points: list[tuple[float, float]], starts: list[float]
              ) -> tuple[list[float], list[float]]:
    """The least and the most of a step function (`points`: (t, value), in time) over each
    bin of steps, a step running from its start to the next one's (the readings before the
    first step count in it); at most `ENVELOPE_BINS` bins."""
    per_bin = -(-len(starts) // ENVELOPE_BINS)
    bins = -(-len(starts) // per_bin)
    low, high = [0.0] * bins, [0.0] * bins
    value: float | None = None  # in force at the start of the bin the loop is in
    point = 0
    for b in range(bins):
        end = starts[(b + 1) * per_bin] if (b + 1) * per_bin < len(starts) else math.inf
        seen = [] if value is None else [value]
        while point < len(points) and points[point][0] < end:
            value = points[point][1]
            seen.append(value)
            point += 1
        if seen:
            low[b], high[b] = min(seen), max(seen)
    return low, high


def _offline_wandb(directory: Path, config: dict[str, Any]) -> Any:
    """An offline W&B run under `directory`, its steps and memory readings each on their
    own x axis (`rl/step`, `memory/reading`)."""
    try:
        import wandb
    except ImportError:
        raise RuntimeError("run.wandb=true needs Weights & Biases: pip install wandb "
                           "(or leave run.wandb=false; TensorBoard events are written "
                           "either way)") from None
    directory.mkdir(parents=True, exist_ok=True)
    run = wandb.init(mode="offline", dir=str(directory), project="colocate-rl-loop",
                     config=config, settings=wandb.Settings(silent=True))
    run.define_metric("rl/*", step_metric="rl/step")
    run.define_metric("memory_mib/*", step_metric="memory/reading")
    return run
