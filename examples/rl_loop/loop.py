"""The RL loop: GRPO with a trainer and a generator time-sharing the same slots.

Every step: the generator samples a group of completions per prompt (generator awake), the
rewards give group-relative advantages, the trainer takes a step (trainer awake), and the
trainer's weights go to the generator by a staged handoff (the generator ends awake, so
the next step's generation needs no switch). Every switch goes through the arbiters and
is checked by measurement.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from colocate import init, phase
from colocate.engines.actors import GeneratorActor, TrainerActor
from colocate.engines.models import load_tokenizer
from colocate.engines.sampling import SamplingParams
from colocate.engines.tiny import write_tiny_model
from examples.rl_loop import task
from examples.rl_loop.config import RLConfig, as_dict
from examples.rl_loop.grpo import group_advantages
from examples.rl_loop.record import RunRecord
from examples.rl_loop.rollouts import GRPOLoss, make_batch
from services import Service, ServiceConfig, spawn_service, sync_weights
from services.replica import Replica, ReplicaState

ROOT = Path(__file__).resolve().parents[2]


def model_dir(cfg: RLConfig, out: Path) -> Path:
    """The initial policy's Hugging Face directory, which every engine loads: `model.path`,
    or a tiny random model over the task's characters written under `out`."""
    m = cfg.model
    if m.path is not None:
        return Path(m.path)
    return write_tiny_model(out / "model", m.architecture, alphabet=task.ALPHABET,
                            hidden_size=m.hidden_size, layers=m.layers, heads=m.heads,
                            kv_heads=m.kv_heads, intermediate_size=m.intermediate_size,
                            max_positions=m.max_positions, init_std=m.init_std, seed=m.seed)


async def resident(service: Service) -> int:
    """Bytes the service's healthy tenants hold now, over all their procs (asked directly,
    since a sleeping replica takes no routed calls)."""
    total = 0
    for replica in service.replicas:
        if replica.state is not ReplicaState.HEALTHY:
            continue  # died: what it held went with its procs
        infos = await replica.actors.describe.call()
        total += sum(info.resident_bytes for _, info in infos.items())
    return total


class Loop:
    """One run: the runtime, the two services, the task, and what is recorded."""

    def __init__(self, cfg: RLConfig) -> None:
        self.cfg = cfg
        self.out = Path(cfg.run.out)
        # transformers' per-load progress bars (here and in the procs) would bury the loop's
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        self.model_dir = model_dir(cfg, self.out)
        self.tokenizer = load_tokenizer(self.model_dir)  # checks the directory first
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id
        self.rng = random.Random(cfg.run.seed)
        self.record = RunRecord(config=as_dict(cfg), logdir=self.out / "tensorboard",
                                wandb_dir=self.out if cfg.run.wandb else None)
        self.bar: tqdm | None = None
        self.training = asyncio.Lock()  # held from a train step through its weight sync
        self.resyncs = 0  # generator replicas given the weights after a respawn
        self.postfix: dict[str, str] = {}  # the progress bar's reward, eval and phase
        self.sampling = SamplingParams(max_new_tokens=cfg.task.max_new_tokens,
                                       temperature=cfg.grpo.temperature,
                                       stop_token_ids=(self.tokenizer.eos_token_id,))
        self.greedy = SamplingParams(max_new_tokens=cfg.task.max_new_tokens, temperature=0,
                                     stop_token_ids=(self.tokenizer.eos_token_id,))

    async def start(self) -> None:
        run = self.cfg.run
        # the procs unpickle this example's loss function: they need the repo on their path
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        # vLLM logs each weight load at INFO, once a step, over the progress bar
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        path = str(self.model_dir)
        slots = run.slots if run.colocate else 2 * run.slots
        self.rm = await init("local", gpus_per_host=slots)
        groups = ("rl", "rl") if run.colocate else ("train", "generate")
        # no respawn for the trainer: its weights and optimizer state die with its procs,
        # and a trainer back at step 0 would be a silent restart
        self.trainer = await spawn_service(
            ServiceConfig(procs_per_host=run.slots, resource_group=groups[0], respawn=False),
            TrainerActor, path, lr=self.cfg.grpo.lr,
            max_grad_norm=self.cfg.grpo.max_grad_norm, name="trainer",
            **vars(self.cfg.trainer))
        config, options = self._generator_service(groups[1])
        self.generator = await spawn_service(config, GeneratorActor, path,
                                             name="generator", **options)
        self.generator.on_respawn.append(self._resync)
        await sync_weights(self.trainer, self.generator)  # it starts awake, with those

    def _generator_service(self, group: str) -> tuple[ServiceConfig, dict[str, Any]]:
        """The generator's service config and engine options. The torch engine: one
        replica per slot; vLLM on several slots: one replica over all of them (tp x dp
        ranks, called SPMD), the node-scale hybrid engine."""
        run, options = self.cfg.run, {"engine": self.cfg.run.engine}
        if run.engine == "torch":
            # every wake comes with the trainer's weights (a sync): keep none across sleeps
            config = ServiceConfig(num_replicas=run.slots, resource_group=group)
            options["keep_weights"] = False
        elif run.slots == 1:
            config = ServiceConfig(resource_group=group)
        else:
            tp = self.cfg.generator.tensor_parallel_size
            config = ServiceConfig(procs_per_host=run.slots, resource_group=group)
            options.update(tensor_parallel_size=tp, data_parallel_size=run.slots // tp)
        return config, options

    async def _resync(self, replica: Replica) -> None:
        """A generator replica came back from a failure with the initial weights: give it
        the trainer's before it takes a call (never while a train step or a sync runs)."""
        async with self.training:
            await sync_weights(self.trainer, self.generator, [replica])
        self.resyncs += 1

    async def stop(self) -> None:
        await self.rm.shutdown()

    async def _readings(self, label: str) -> None:
        """Mark a phase switch and record what each side holds now."""
        self.record.phase(label)
        self.postfix["phase"] = label
        if self.bar is not None:  # shown now: the bar otherwise redraws only at a step's end
            self.bar.set_postfix(self.postfix)
        for name, service in (("trainer", self.trainer), ("generator", self.generator)):
            self.record.reading(name, await resident(service))

    async def generate(self, prompts: list[str], params: SamplingParams, copies: int
                       ) -> tuple[list[list[int]], list]:
        """`copies` completions per prompt, spread over the generator's replicas."""
        tokens = [self.encode(p) for p in prompts for _ in range(copies)]
        chunks = max(1, len(self.generator.replicas))
        size = -(-len(tokens) // chunks)
        parts = await asyncio.gather(*(
            self.generator.generate.route(tokens[i:i + size], self._seeded(params, i))
            for i in range(0, len(tokens), size)))
        return tokens, [c for part in parts for c in part]

    def encode(self, text: str) -> list[int]:
        """A prompt's token ids, with the special tokens the model's tokenizer adds."""
        return self.tokenizer(text).input_ids

    def decode(self, tokens: list[int]) -> str:
        """A completion's text, without special tokens (the stop token among them)."""
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    @staticmethod
    def _seeded(params: SamplingParams, first: int) -> SamplingParams:
        """`params` for the prompts from index `first` on: request i of the whole batch is
        seeded with seed + i, whichever replica serves it, so a run repeats exactly."""
        return params if params.seed is None else dataclasses.replace(params,
                                                                       seed=params.seed + first)

    async def evaluate(self) -> float:
        prompts = task.eval_prompts(self.cfg.task)
        _, completions = await self.generate(prompts, self.greedy, 1)
        rewards = [task.reward(p, self.decode(c.tokens))
                   for p, c in zip(prompts, completions, strict=True)]
        return sum(rewards) / len(rewards)

    async def step(self, index: int) -> dict[str, Any]:
        """One GRPO step; returns its metrics and where its time went. The memory readings
        taken for the plots are timed apart (`readings_s`), outside every other figure."""
        cfg, clock = self.cfg, time.monotonic
        start = clock()
        async with phase(self.generator):  # no switch: the last sync left it awake
            woken = clock()
            await self._readings("generate")
            generating = clock()
            prompts = task.sample_prompts(cfg.task, cfg.grpo.prompts_per_step, self.rng)
            sampling = dataclasses.replace(self.sampling,
                                           seed=cfg.run.seed * 1_000_003 + index * 10_007)
            tokens, completions = await self.generate(prompts, sampling,
                                                      cfg.grpo.group_size)
        generated = clock()
        texts = [p for p in prompts for _ in range(cfg.grpo.group_size)]
        rewards = torch.tensor([task.reward(p, self.decode(c.tokens))
                                for p, c in zip(texts, completions, strict=True)])
        advantages = group_advantages(rewards, cfg.grpo.group_size, cfg.grpo.scale_by_std,
                                      cfg.grpo.eps)
        batch = make_batch(tokens, completions, advantages, self.pad_id)
        scored = clock()
        async with self.training:
            async with phase(self.trainer):
                trainer_woken = clock()
                await self._readings("train")
                training = clock()
                for _ in range(cfg.grpo.updates_per_batch):
                    metrics = await self.trainer.train_step.route(GRPOLoss(cfg.grpo), batch)
            trained = clock()
            await sync_weights(self.trainer, self.generator)
        synced = clock()
        await self._readings("sync")
        readings = (generating - woken) + (training - trainer_woken)
        row = {"step": index, "reward": rewards.mean().item(), **metrics,
               "generate_s": generated - generating, "score_s": scored - generated,
               "train_s": trained - training,
               "switch_s": (woken - start) + (trainer_woken - scored),
               "sync_s": synced - trained, "step_s": synced - start - readings,
               "readings_s": readings + (clock() - synced)}
        if (index + 1) % cfg.run.eval_every == 0 or index + 1 == cfg.run.steps:
            row["eval_reward"] = await self.evaluate()
        return row

    async def run(self) -> dict[str, Any]:
        """Train for `run.steps` steps; write the plots and metrics.json (also, with what
        was done and the error, when the run fails) and return the summary."""
        await self.start()
        try:
            await self._train()
        except BaseException as err:
            self.record.write(self.out, {"failed": f"{type(err).__name__}: {err}"})
            raise
        finally:
            await self.stop()
        first, *steps = self.record.steps
        summary = {
            "untrained_eval_reward": first["eval_reward"],
            "final_eval_reward": steps[-1]["eval_reward"],
            "mean_step_s": sum(s["step_s"] for s in steps) / len(steps),
            "switch_share": sum(s["switch_s"] + s["sync_s"] for s in steps)
            / sum(s["step_s"] for s in steps),
            "engine": self.cfg.run.engine,
            "generator_respawns": self.resyncs,
        }
        self.record.write(self.out, summary)
        return summary

    async def _train(self) -> None:
        await self._readings("start")
        async with phase(self.generator):
            untrained = await self.evaluate()
        self.postfix["eval"] = f"{untrained:.2f}"
        self.record.step({"step": -1, "reward": None, "eval_reward": untrained})
        self.bar = tqdm(range(self.cfg.run.steps), desc="GRPO")
        for index in self.bar:
            row = await self.step(index)
            self.record.step(row)
            self.postfix["reward"] = f"{row['reward']:.2f}"
            if "eval_reward" in row:
                self.postfix["eval"] = f"{row['eval_reward']:.2f}"
            self.bar.set_postfix(self.postfix, refresh=False)
        self.bar.close()
