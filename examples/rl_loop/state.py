"""What a run keeps on disk to go on later: the loop's own state and the run's checkpoints.

    run.out/checkpoints/step_00000020/trainer/    the trainer's checkpoint (DCP, each rank
                                                  its part; `colocate.engines.checkpoint`)
    run.out/checkpoints/step_00000020/loop.json   `LoopState` after 20 steps

A step's checkpoint is complete when both parts are: the trainer renames its directory
into place only once every rank's part is written, and loop.json is written under a
temporary name and renamed. A half-written checkpoint (a run killed during a save, a disk
that filled) is never picked for a resume; `run.keep_last` complete ones stay.

`LoopState` is the one object a resume needs besides the trainer: the next step, the prompt
sampler's position, the metrics, memory readings and phases so far (so metrics.json of a
resumed run holds every step from the first), the restarts, and the settings that define
the run. The sampling seed of step i is a function of run.seed and i (`Loop.step`), so it
needs no state of its own.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from colocate.engines.checkpoint_files import is_complete

FORMAT = 1
# The settings that make a run what it is: a resume that changes one is a different run.
# run.steps may grow; where the output goes, how often it saves or evaluates, and how the
# trainer is sharded (DCP reshards its checkpoint) may change; so may reward.workers (where
# the reward functions run, not what they say).
IDENTITY = ("model", "task", "data", "reward.funcs", "reward.weights", "reward.on_error",
            "grpo", "run.seed", "run.engine")
# and `rollout`, once a run is not sync or calls tools (and then `tools.funcs`), and
# `env.cls` where an environment steps the episodes, so the checkpoints of plain sync runs
# resume as before


class ResumeError(RuntimeError):
    """A resume that cannot be made: the message names the checkpoint and what to do."""


class PromptSampler:
    """The training prompts' source: a `random.Random` seeded by run.seed, whose state is
    the sampler's position."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self.rng.getstate()
        return {"version": version, "internal": list(internal), "gauss": gauss}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.setstate((state["version"], tuple(state["internal"]), state["gauss"]))


@dataclass
class LoopState:
    """The loop's side of a checkpoint (the trainer's side is its own directory)."""

    step: int  # steps done: the next step to run
    sampler: dict[str, Any]  # PromptSampler.state_dict()
    identity: dict[str, Any]  # the IDENTITY settings of the run that saved it
    metrics: list[dict[str, Any]] = field(default_factory=list)  # step -1 first
    memory: list[dict[str, Any]] = field(default_factory=list)
    phases: list[tuple[float, str]] = field(default_factory=list)
    restarts: list[dict[str, Any]] = field(default_factory=list)
    elapsed_s: float = 0.0  # the run's clock at the save: a resumed record goes on from it
    carried: dict[str, Any] | None = None  # rollout.mode=partial: the pool (partial.Pool)
    format: int = FORMAT

    def write(self, path: Path) -> None:
        """To `path`, atomically: a reader sees the old file, or none, or this one."""
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(asdict(self)))
        os.replace(temporary, path)

    @classmethod
    def read(cls, path: Path) -> LoopState:
        try:
            data = json.loads(path.read_text())
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, this loop reads {FORMAT}")
            data["phases"] = [tuple(p) for p in data["phases"]]
            return cls(**data)
        except (OSError, ValueError, TypeError, KeyError) as err:
            raise ResumeError(f"{path}: not a loop state this loop can read "
                              f"({type(err).__name__}: {err}); resume from another "
                              "checkpoint (run.resume=DIR) or start anew "
                              "(run.resume=none)") from None


def identity(config: dict[str, Any]) -> dict[str, Any]:
    """The IDENTITY settings of a resolved configuration (`config.as_dict`), by dotted name."""
    found = {}
    rollout = config.get("rollout", {"mode": "sync"})
    tools, env = config.get("tools", {}).get("funcs"), config.get("env", {}).get("cls")
    if rollout["mode"] != "sync" or tools or env:
        found["rollout"] = rollout
    if tools:  # episodes with tools: which tools they call
        found["tools.funcs"] = tools
    if env:  # episodes stepped by an environment: which one
        found["env.cls"] = env
    for name in IDENTITY:
        value: Any = config
        for key in name.split("."):
            value = value[key]
        found[name] = value
    return found


def changed(saved: dict[str, Any], now: dict[str, Any],
            defaults: dict[str, Any] | None = None) -> list[str]:
    """The dotted fields whose values differ, `field (saved -> now)`, leaves only. A field
    `saved` lacks (the loop that saved it had no such field) counts as its value in
    `defaults`, so adding a field with a default keeps older checkpoints resumable."""
    out, defaults = [], defaults or {}
    for key in sorted(set(saved) | set(now)):
        old, new = saved.get(key, defaults.get(key)), now.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            out += [f"{key}.{item}" for item in changed(old, new, defaults.get(key))]
        elif old != new:
            out.append(f"{key} ({old!r} -> {new!r})")
    return out


class Checkpoints:
    """The run's checkpoints under `root` (run.out/checkpoints), newest last."""

    def __init__(self, root: Path, keep_last: int) -> None:
        self.root, self.keep_last = root, keep_last

    def path(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def complete(self) -> list[Path]:
        """The complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob("step_*") if _complete(p)]
        return sorted(found, key=lambda p: p.name)

    def prune(self) -> None:
        """Keep the newest `keep_last` complete checkpoints; remove older ones, and what
        older saves left half-written (a save in flight is newer than every complete one)."""
        kept = self.complete()[-self.keep_last:]
        if not kept:
            return
        for path in self.root.glob("step_*"):
            if path.name < kept[0].name:
                shutil.rmtree(path, ignore_errors=True)

    def clear(self) -> int:
        """Remove every checkpoint here (a run that starts anew); returns how many."""
        found = list(self.root.glob("step_*")) if self.root.is_dir() else []
        for path in found:
            shutil.rmtree(path, ignore_errors=True)
        return len(found)


def _complete(path: Path) -> bool:
    return (path / "loop.json").is_file() and is_complete(path / "trainer")


def find_resume(resume: str, checkpoints: Checkpoints, config: dict[str, Any],
                defaults: dict[str, Any] | None = None) -> tuple[Path, LoopState] | None:
    """The checkpoint `run.resume` names (`auto`: the newest complete one under run.out,
    else None; `none`: None; a directory: that checkpoint, or the newest under it), with its
    loop state, checked against this run's settings (`defaults`: the default
    configuration, for the fields the saving loop did not have)."""
    if resume == "none":
        return None
    if resume == "auto":
        found = checkpoints.complete()
        if not found:
            return None
        path = found[-1]
    else:
        path = Path(resume)
        if not path.is_dir():
            raise ResumeError(f"run.resume={resume}: no such directory; give a checkpoint "
                              "(a step_* directory under run.out/checkpoints), auto or none")
        if not _complete(path):
            under = Checkpoints(path / "checkpoints" if (path / "checkpoints").is_dir()
                                else path, 1).complete()
            if not under:
                raise ResumeError(f"run.resume={resume}: not a complete checkpoint (it needs "
                                  "trainer/ with its .metadata and loop.json) and none is "
                                  "under it; a save that was cut short leaves such a "
                                  "directory: give an earlier one")
            path = under[-1]
    state = LoopState.read(path / "loop.json")
    differ = changed(state.identity, identity(config),
                     identity(defaults) if defaults is not None else None)
    if differ:
        raise ResumeError(
            f"{path} was saved by a run with other settings: {', '.join(differ)}. A resumed "
            "run must be the same run (only run.steps may grow): resume with those settings, "
            "or start anew in another run.out (or with run.resume=none)")
    return path, state


class RunLock:
    """Only one run writes into a run.out at a time: a second is refused, naming the
    first's pid. The lock (flock on run.out/.lock) goes with the process, even when it is
    killed."""

    def __init__(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / ".lock"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(self.fd, 32).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            raise ResumeError(f"run.out={out} is in use by another run (pid {holder}): give "
                              "this run another run.out, or wait for that one to end") from None
        os.ftruncate(self.fd, 0)
        os.write(self.fd, str(os.getpid()).encode())

    def release(self) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1
