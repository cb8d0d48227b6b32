"""The run's configuration: OmegaConf structured configs, the dataclasses below as schema.

    model:    the policy: a local Hugging Face directory (`model.path`), or a tiny random
              model of the shape given here, built for the run
    trainer:  how the trainer trains (`trainer.parallel=ddp|fsdp`...)
    generator: how a vLLM generator spans the slots (`generator.tensor_parallel_size=2`)
    task:     TaskConfig fields (the built-in digit task)
    data:     DataConfig fields: the user's prompt files instead of the digit task
    reward:   RewardConfig fields: the user's reward functions for them
    grpo:     GRPOConfig fields
    rollout:  RolloutConfig fields: sync, or partial rollouts with a token budget per step
    run:      RunConfig fields
    tools:    ToolsConfig fields: the user's tools, called in a service of their own
    env:      EnvConfig fields: the user's stateful environment for multi-turn rollouts

The YAML file is merged over the defaults, then the command line's `section.field=value`
overrides (`run.steps=20`, `grpo.lr=1e-3`, `model.path=/models/qwen`). Each value is
converted to its field's type or refused in one line naming the field and the type (a list
field given one value, `data.train_files=train.jsonl`, is a list of that one); each
section validates itself when built. The comment beside a field is its meaning, which
`python -m examples.rl_loop --help` lists.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_origin, get_type_hints

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from colocate.engines.parallel import PARALLEL
from colocate.engines.tiny import ARCHITECTURES
from colocate.engines.trainer import BUCKET_MB
from examples.rl_loop.data import DataConfig
from examples.rl_loop.envs import EnvConfig
from examples.rl_loop.grpo import GRPOConfig
from examples.rl_loop.rewards import RewardConfig
from examples.rl_loop.rollouts import RolloutConfig
from examples.rl_loop.task import TaskConfig
from examples.rl_loop.tools import ToolsConfig

DEFAULT = Path(__file__).with_name("config.yaml")
ENGINES = ("torch", "vllm")
GENERATOR_REPLICAS = ("spmd", "per_copy")  # how a vLLM generator's model copies are served
POLICIES = ("budget", "exclusive")  # the arbiter's (colocate.arbiter.policy)
SCHEDULERS = ("local", "processes", "slurm")  # and torchx:<name> (colocate.resources.hosts)


@dataclass(frozen=True)
class ModelConfig:
    """The policy. With `path`, that Hugging Face directory and its own tokenizer; without,
    a random `architecture` model of this shape over the task's characters."""

    path: str | None = None  # a local Hugging Face causal-LM directory; null: a tiny one
    architecture: str = "llama"  # the tiny model's transformers architecture
    hidden_size: int = 64  # the tiny model's width
    layers: int = 2  # the tiny model's decoder layers
    heads: int = 2  # the tiny model's attention heads
    kv_heads: int = 1  # the tiny model's key/value heads (grouped-query attention)
    intermediate_size: int = 128  # the tiny model's MLP width
    max_positions: int = 32  # the tiny model's longest sequence, prompt and completion
    init_std: float = 0.1  # the tiny model's initializer_range: at 0.02 (transformers'
    # default) the toy task learns about half as fast (eval 0.46 at step 300; 0.87 with 0.1)
    seed: int = 0  # the tiny model's random weights

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"model.architecture={self.architecture!r}: use one of "
                             f"{ARCHITECTURES}")
        for name in ("hidden_size", "layers", "heads", "kv_heads", "intermediate_size",
                     "max_positions"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}={getattr(self, name)}: must be >= 1")


@dataclass(frozen=True)
class TrainerConfig:
    """How the trainer replica trains on its procs (see `colocate.engines.trainer`)."""

    parallel: str = "ddp"  # "ddp" or "fsdp" (FSDP2), when it spans several procs
    mixed_precision: bool = False  # fsdp: bf16 compute, fp32 gradient reduction
    activation_checkpointing: bool = False  # recompute activations in backward: less memory
    bucket_mb: int = BUCKET_MB  # a weight sync moves full tensors this many MiB at a time

    def __post_init__(self) -> None:
        if self.bucket_mb < 1:
            raise ValueError(f"trainer.bucket_mb={self.bucket_mb}: must be >= 1")
        if self.parallel not in PARALLEL:
            raise ValueError(f"trainer.parallel={self.parallel!r}: use one of {PARALLEL}")
        if self.mixed_precision and self.parallel != "fsdp":
            raise ValueError("trainer.mixed_precision=true needs trainer.parallel=fsdp")


@dataclass(frozen=True)
class GeneratorConfig:
    """The generator's replicas. vLLM on several slots, `replicas=spmd`: one replica over
    all of them, beside the trainer on the same procs, `tensor_parallel_size` ranks per
    model copy and slots / that many data-parallel copies, called in lockstep (its copies
    split each call's rows by position). `replicas=per_copy`: each model copy an
    independent replica of `tensor_parallel_size` slots, so an episode's turns all reach
    the copy that holds its prefix in vLLM's cache (the loop routes them by session); it
    needs slots of its own (`run.colocate=false`) when there are several copies: an engine
    of fewer ranks than the trainer cannot share its torch.distributed world. The torch
    generator is one replica per slot either way."""

    tensor_parallel_size: int = 1  # vLLM: ranks per model copy; it divides run.slots
    replicas: str = "spmd"  # vLLM: spmd (one replica over all slots) or per_copy (one per
    # model copy, each routed its own episodes; needs run.colocate=false)
    block_size: int = 0  # vLLM: tokens per KV block, its prefix cache's unit of reuse
    # (0: vLLM's own, 128 on CPU, 16 on CUDA; CPU takes multiples of 32)
    max_batch: int = 64  # rows a replica decodes together (torch) or at most (vLLM)
    max_model_len: int = 0  # vLLM: the longest sequence it serves, prompt and completion,
    # for which its KV cache is sized (0: the model's max_position_embeddings)
    session_cache_mb: int = 0  # torch: MiB of KV prefixes kept between an episode's turns

    def __post_init__(self) -> None:
        if self.replicas not in GENERATOR_REPLICAS:
            raise ValueError(f"generator.replicas={self.replicas!r}: use one of "
                             f"{GENERATOR_REPLICAS}")
        if self.block_size < 0:
            raise ValueError(f"generator.block_size={self.block_size}: must be >= 0 (0: "
                             "vLLM's own)")
        if self.max_batch < 1:
            raise ValueError(f"generator.max_batch={self.max_batch}: must be >= 1")
        if self.max_model_len < 0:
            raise ValueError(f"generator.max_model_len={self.max_model_len}: must be >= 0 "
                             "(0: the model's max_position_embeddings)")
        if self.session_cache_mb < 0:
            raise ValueError(f"generator.session_cache_mb={self.session_cache_mb}: must be "
                             ">= 0 (0: no cache, every turn prefilled anew)")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"generator.tensor_parallel_size={self.tensor_parallel_size}: "
                             "must be >= 1")


@dataclass(frozen=True)
class RunConfig:
    steps: int = 300  # GRPO steps in all (a resumed run goes on up to this many)
    eval_every: int = 50  # the held-out evaluation every N steps (and at the end)
    seed: int = 0  # sampling and the prompts' order
    engine: str = "torch"  # the generator: "torch" (built-in) or "vllm"
    slots: int = 1  # GPUs, or CPU procs standing in for them, per host; trainer and generator share
    hosts: int = 1  # hosts the run spans: the trainer over every slot of every host
    scheduler: str = "local"  # where the hosts come from: local (this one), processes (local
    # subprocess hosts), slurm (sbatch, one node a host), torchx:<scheduler>
    host_timeout_s: float = 300.0  # the hosts' start may take this long, queueing included
    colocate: bool = True  # False: trainer and generator on separate slots (for comparison)
    out: str = "runs/rl_loop"  # the run's directory: plots, metrics.json, checkpoints, model
    wandb: bool = False  # also log to Weights & Biases, offline (`wandb sync` uploads)
    save_every: int = 50  # a checkpoint every N steps and at the end (0: never)
    keep_last: int = 2  # complete checkpoints kept under out/checkpoints
    resume: str = "auto"  # auto: the newest complete checkpoint under out, else anew;
    # none: start anew (the checkpoints of an earlier run there are removed); or a directory
    export_every: int = 0  # also write out/model every N steps (0: at the end only)
    max_restarts: int = 3  # a lost proc: restart the slots, reload the last checkpoint
    policy: str = "budget"  # budget: only what a slot lacks moves; exclusive: one awake a slot
    slot_memory: str = "auto"  # a slot's capacity in bytes (or KiB/MiB/GiB/TiB); auto: see
    # budget.py
    host_memory: str = "auto"  # each host's memory for the backups of sleeping stages, in
    # bytes (or KiB/MiB/GiB/TiB); past it they go to disk (auto: the cgroup's limit, else
    # what the host has available at start; see colocate/arbiter/host_budget.py)
    backup_dir: str = ""  # where backups go that host memory has no room for: a directory
    # on a disk, not tmpfs ("": $COLOCATE_BACKUP_DIR, else the system temp dir)
    cpu_threads: int = 0  # torch's intra-op threads in each slot proc (0: torch's, every core)
    call_timeout_s: float = 0.0  # a call to a slot proc past this counts as a hung proc:
    # killed, and its group restarted as after a crash (0: the services' and arbiter's own)
    rates: str = ""  # the rates file the run's plan is priced with ("": this machine's own)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"run.engine={self.engine!r}: use one of {ENGINES}")
        for name in ("steps", "eval_every", "slots", "keep_last"):
            if getattr(self, name) < 1:
                raise ValueError(f"run.{name}={getattr(self, name)}: must be >= 1")
        for name in ("save_every", "export_every", "max_restarts", "cpu_threads",
                     "call_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"run.{name}={getattr(self, name)}: must be >= 0")
        if not self.resume:
            raise ValueError("run.resume='': use auto, none or a checkpoint directory")
        if self.hosts < 1:
            raise ValueError(f"run.hosts={self.hosts}: must be >= 1")
        if self.scheduler not in SCHEDULERS and not re.fullmatch(r"torchx:\w+", self.scheduler):
            raise ValueError(f"run.scheduler={self.scheduler!r}: use one of {SCHEDULERS} or "
                             "torchx:<scheduler> (torchx:local_cwd, torchx:slurm...)")
        if self.scheduler == "local" and self.hosts > 1:
            raise ValueError(f"run.hosts={self.hosts} with run.scheduler=local, which is this "
                             "one host: give run.scheduler=processes (local hosts) or slurm")
        if not self.host_timeout_s > 0:
            raise ValueError(f"run.host_timeout_s={self.host_timeout_s}: must be > 0")
        if self.policy not in POLICIES:
            raise ValueError(f"run.policy={self.policy!r}: use one of {POLICIES}")
        for name in ("slot_memory", "host_memory"):
            value = getattr(self, name)
            if value != "auto" and not re.fullmatch(r"\d+(\.\d+)?(KiB|MiB|GiB|TiB)?|\d+",
                                                    str(value).strip()):
                raise ValueError(f"run.{name}={value!r}: give bytes (e.g. 4000000000 or "
                                 "4GiB) or auto")


@dataclass(frozen=True)
class RLConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    run: RunConfig = field(default_factory=RunConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    env: EnvConfig = field(default_factory=EnvConfig)

    def __post_init__(self) -> None:
        if self.data.used and not self.reward.funcs:
            raise ValueError("data.train_files needs reward.funcs: the functions that score "
                             "its completions (module:function or path/to/file.py:function)")
        if self.reward.funcs and not self.data.used:
            raise ValueError("reward.funcs without data.train_files: the digit task has its "
                             "own reward; give your prompts in data.train_files")
        if self.data.used and self.grpo.max_completion_length is None:
            raise ValueError("data.train_files needs grpo.max_completion_length: the most "
                             "tokens a completion may have (the digit task sets its own)")
        if self.tools.used and not self.data.used:
            raise ValueError("tools.funcs needs data.train_files: the prompts whose episodes "
                             "call the tools (and reward.funcs to score them)")
        if self.grpo.dynamic_sampling and self.rollout.partial:
            raise ValueError("grpo.dynamic_sampling=true with rollout.mode=partial: a partial "
                             "step trains the groups its token budget finished, it has no "
                             "rounds to refill; use rollout.mode=sync")
        if self.env.used and not self.data.used:
            raise ValueError("env.cls needs data.train_files: the rows each episode's "
                             "reset(row) opens from (and reward.funcs to score them)")
        if self.rollout.overlap and self.run.policy == "exclusive" and self.run.colocate:
            raise ValueError("rollout.overlap=true generates beside the training, but "
                             "run.policy=exclusive keeps one tenant awake a slot: use "
                             "run.policy=budget, or drop rollout.overlap")
        tp = self.generator.tensor_parallel_size
        ranks = tp if self.generator.replicas == "per_copy" else self.run.slots * self.run.hosts
        if self.rollout.continuous and self.run.engine == "vllm" and ranks > 1:
            raise ValueError(f"rollout.continuous=true with vLLM needs one-rank replicas, but "
                             f"each has {ranks} ranks, which step together on the same calls: "
                             "use generator.replicas=per_copy with "
                             "generator.tensor_parallel_size=1 (or run.slots=1)")
        if self.run.slots % tp:
            raise ValueError(f"generator.tensor_parallel_size={tp} does not divide "
                             f"run.slots={self.run.slots}: every slot holds one vLLM rank")
        copies = self.run.slots * self.run.hosts // tp
        if self.run.engine == "vllm" and self.generator.replicas == "per_copy" \
                and self.run.colocate and copies > 1:
            raise ValueError(f"generator.replicas=per_copy with run.colocate=true: its {copies} "
                             "vLLM replicas cannot each join the trainer's torch.distributed "
                             "world on the shared procs; give run.colocate=false (slots of "
                             "their own) or generator.replicas=spmd")

    @property
    def served_positions(self) -> int:
        """The generator's own bound on a sequence, prompt and completion, which sizes
        vLLM's KV cache (`generator.max_model_len`; 0: none, the model's)."""
        return self.generator.max_model_len if self.run.engine == "vllm" else 0


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> RLConfig:
    """The YAML file (default: config.yaml beside this module) with `overrides` applied. A
    list field given one value (`data.train_files=a.jsonl`, `train_files: a.jsonl` in the
    file) is a list of that one; given none (`data.train_files=`), the empty list. Every
    error is a ValueError of one line naming the field (or the file) and the value."""
    bad = [item for item in overrides if "=" not in item or "." not in item.split("=")[0]]
    if bad:
        raise ValueError(f"override {bad[0]!r}: write section.field=value, e.g. run.steps=20")
    file = Path(path or DEFAULT)
    try:
        layers = [_as_lists(_read_yaml(file))]
        for item in overrides:
            try:
                layers.append(_as_lists(OmegaConf.to_container(OmegaConf.from_dotlist([item]),
                                                               resolve=False)))
            except yaml.YAMLError as err:
                raise ValueError(f"{item}: not a value the command line can read "
                                 f"({_first_line(err)}); quote it, e.g. "
                                 f"'{item.split('=')[0]}=\"...\"'") from None
        merged = OmegaConf.merge(OmegaConf.structured(RLConfig), *layers)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ValueError(_one_line(err)) from None


def as_overridden(message: str) -> str:
    """An error's message with each section's class named as its overrides name it:
    `GRPOConfig.lr=0: must be > 0` -> `grpo.lr=0: must be > 0`."""
    for section, cls in sections().items():
        message = message.replace(f"{cls.__name__}.", f"{section}.")
        message = message.replace(f"{cls.__name__}:", f"{section}:")
    return message


def _read_yaml(file: Path) -> dict[str, Any]:
    """The config file as plain data, refused in one line when missing or not YAML."""
    if not file.is_file():
        raise ValueError(f"--config {file}: no such file; give a YAML file like "
                         f"{DEFAULT}")
    try:
        data = OmegaConf.to_container(OmegaConf.load(file), resolve=False)
    except yaml.YAMLError as err:
        raise ValueError(f"--config {file}: not YAML ({_first_line(err)})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {file}: expected sections (model:, run: ...), "
                         f"got a {type(data).__name__}")
    return data


def sections() -> dict[str, type]:
    """Each section's dataclass: {"model": ModelConfig, ...}."""
    hints = get_type_hints(RLConfig)
    return {f.name: hints[f.name] for f in fields(RLConfig)}


def list_fields() -> list[tuple[str, str]]:
    """The (section, field) pairs whose type is a list (`data.train_files`...)."""
    found = []
    for section, cls in sections().items():
        hints = get_type_hints(cls)
        found += [(section, f.name) for f in fields(cls) if get_origin(hints[f.name]) is list]
    return found


def _as_lists(values: Any) -> Any:
    """`values` (a config file's or an override's, as plain data) with each list field
    given one value made a list of it (None or "": the empty list)."""
    if not isinstance(values, dict):
        return values
    for section, name in list_fields():
        entries = values.get(section)
        if isinstance(entries, dict) and name in entries:
            value = entries[name]
            if value is None or value == "":
                entries[name] = []
            elif not isinstance(value, list | tuple):
                entries[name] = [value]
    return values


def _first_line(err: Exception) -> str:
    return " ".join(str(err).split("\n")[0].split()) or type(err).__name__


def as_dict(cfg: RLConfig) -> dict[str, Any]:
    """The resolved configuration as plain data (what metrics.json records)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg))


def _one_line(err: OmegaConfBaseException) -> str:
    """OmegaConf's error as one line naming the field: `run.steps='abc': expected int`."""
    key = getattr(err, "full_key", None) or "?"
    if getattr(err, "value", None) is not None and "converted" in str(err):
        expected = str(err).splitlines()[0].rsplit(" to ", 1)[-1]
        return f"{key}={err.value!r}: expected a value of type {expected}"
    return f"{key}: {str(err).splitlines()[0]}"

