"""The run's configuration: YAML sections with command-line overrides, each section a
dataclass that validates itself.

    model:  LlamaConfig fields (vocab_size comes from the task's alphabet)
    task:   TaskConfig fields
    grpo:   GRPOConfig fields
    run:    RunConfig fields

Overrides are `section.field=value`, the value read as YAML (`run.steps=20`,
`grpo.lr=1e-3`, `run.engine=vllm`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from examples.rl_loop.grpo import GRPOConfig
from examples.rl_loop.task import TaskConfig

DEFAULT = Path(__file__).with_name("config.yaml")
ENGINES = ("torch", "vllm")


@dataclass(frozen=True)
class ModelConfig:
    """The policy's shape (a `LlamaConfig` without the vocabulary, which the task sets)."""

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 2
    n_kv_heads: int = 1
    hidden_dim: int = 128
    max_seq_len: int = 32
    seed: int = 0


@dataclass(frozen=True)
class RunConfig:
    steps: int = 300
    eval_every: int = 50
    seed: int = 0
    engine: str = "torch"  # the generator: "torch" (built-in) or "vllm"
    slots: int = 1  # GPUs, or CPU procs standing in for them; trainer and generator share
    colocate: bool = True  # False: trainer and generator on separate slots (for comparison)
    out: str = "runs/rl_loop"

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"run.engine={self.engine!r}: use one of {ENGINES}")
        for name in ("steps", "eval_every", "slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"run.{name}={getattr(self, name)}: must be >= 1")


@dataclass(frozen=True)
class RLConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    run: RunConfig = field(default_factory=RunConfig)


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> RLConfig:
    """The YAML file (default: config.yaml beside this module) with `overrides` applied."""
    raw: dict[str, Any] = yaml.safe_load(Path(path or DEFAULT).read_text()) or {}
    for item in overrides:
        key, sep, value = item.partition("=")
        section, dot, name = key.partition(".")
        if not (sep and dot):
            raise ValueError(f"override {item!r}: write section.field=value, e.g. run.steps=20")
        raw.setdefault(section, {})[name] = yaml.safe_load(value)
    sections = {f.name: f.default_factory for f in dataclasses.fields(RLConfig)}
    unknown = set(raw) - set(sections)
    if unknown:
        raise ValueError(f"unknown config section(s) {sorted(unknown)}; sections: {list(sections)}")
    built = {}
    for name, cls in sections.items():
        known = {f.name for f in dataclasses.fields(cls)}
        bad = set(raw.get(name) or {}) - known
        if bad:
            raise ValueError(f"unknown field(s) {sorted(bad)} in section {name!r}; "
                             f"fields: {sorted(known)}")
        built[name] = cls(**(raw.get(name) or {}))
    return RLConfig(**built)
