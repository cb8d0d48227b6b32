"""The RL loop: GRPO with a trainer and a generator time-sharing the same slots.

Every step: the generator samples a group of completions per prompt (generator awake), the
rewards give group-relative advantages, the trainer takes a step (trainer awake), and the
trainer's weights go to the generator by a staged handoff (the generator ends awake, so
the next step's generation needs no switch). Every switch goes through the arbiters and
is checked by measurement. The trainer's wake (the reference's, with `grpo.beta > 0`)
starts as soon as generation ends and runs while the completions are scored: a step's
`switch_s` is the time it waited for switches, `switch_ahead_s` that wake's own duration.

A run is durable: every `run.save_every` steps (and at the end) the trainer saves its
checkpoint while it is awake (staged in host memory, written in the background) and the
loop its own state (`state.LoopState`); `run.resume=auto` goes on from the newest complete
one, as the same run. At the end the trained model is written to `run.out/model/`, a
Hugging Face directory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from colocate import init, phase
from colocate.engines.actors import GeneratorActor, TrainerActor
from colocate.engines.models import load_tokenizer
from colocate.engines.sampling import SamplingParams
from colocate.engines.tiny import write_tiny_model
from examples.rl_loop import task
from examples.rl_loop.config import RLConfig, as_dict
from examples.rl_loop.data import Row
from examples.rl_loop.memory import ProcPeaks, devices_of, resident_per_proc
from examples.rl_loop.record import RunRecord
from examples.rl_loop.recovery import Recovery
from examples.rl_loop.reference import spawn_reference
from examples.rl_loop.rollouts import GRPOLoss, ReferenceLogprobs, scored_batch
from examples.rl_loop.sources import check_fits, make_source
from examples.rl_loop.state import (
    Checkpoints,
    LoopState,
    RunLock,
    find_resume,
    identity,
)
from services import (
    Service,
    ServiceConfig,
    group_restarts,
    spawn_service,
    sync_weights,
)
from services.replica import Replica

ROOT = Path(__file__).resolve().parents[2]
logger = logging.getLogger(__name__)


def model_dir(cfg: RLConfig, out: Path, alphabet: str = task.ALPHABET) -> Path:
    """The initial policy's Hugging Face directory, which every engine loads: `model.path`,
    or a tiny random model over the task's characters (`alphabet`: the digit task's, or
    every character of the user's data) written under `out` (as base_model/: `out/model` is
    the trained one)."""
    m = cfg.model
    if m.path is not None:
        return Path(m.path)
    return write_tiny_model(out / "base_model", m.architecture, alphabet=alphabet,
                            hidden_size=m.hidden_size, layers=m.layers, heads=m.heads,
                            kv_heads=m.kv_heads, intermediate_size=m.intermediate_size,
                            max_positions=m.max_positions, init_std=m.init_std, seed=m.seed)


class Loop:
    """One run: the runtime, the services (trainer, generator and, with grpo.beta > 0, the
    reference), the task, and what is recorded."""

    save_waits = False  # the trainer's saves: staged, then written in the background

    def __init__(self, cfg: RLConfig) -> None:
        self.cfg = cfg
        self.out = Path(cfg.run.out)
        # transformers' per-load progress bars (here and in the procs) would bury the loop's
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        try:
            # the prompts and the reward functions first: a bad file, column or function is
            # refused before anything is built
            self.source = make_source(cfg)
            self.model_dir = model_dir(cfg, self.out, self.source.alphabet)
            self.tokenizer = load_tokenizer(self.model_dir)  # checks the directory first
            self.source.prepare(self.tokenizer)
            check_fits(self.source, self.model_dir)
        except Exception as err:
            self._refused(err)
            raise
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id
        self.sampler = self.source.sampler
        self.sampler_start = self.sampler.state_dict()  # where a restart before any save goes
        # the loss's dr_grpo divisor is the completion limit in force, the task's by default
        self.grpo = dataclasses.replace(cfg.grpo,
                                        max_completion_length=self.source.max_new_tokens)
        self.checkpoints = Checkpoints(self.out / "checkpoints", cfg.run.keep_last)
        self.record = RunRecord(config=as_dict(cfg), logdir=self.out / "tensorboard",
                                wandb_dir=self.out if cfg.run.wandb else None)
        self.bar: tqdm | None = None
        self.reference: Service | None = None
        self.peaks = ProcPeaks()
        self.training = asyncio.Lock()  # held from a train step through its weight sync
        self.resyncs = 0  # generator replicas given the weights after a respawn
        self.postfix: dict[str, str] = {}  # the progress bar's reward, eval and phase
        self.sampling = SamplingParams(max_new_tokens=self.source.max_new_tokens,
                                       temperature=cfg.grpo.temperature,
                                       stop_token_ids=(self.tokenizer.eos_token_id,))
        self.greedy = SamplingParams(max_new_tokens=self.source.max_new_tokens, temperature=0,
                                     stop_token_ids=(self.tokenizer.eos_token_id,))

    def _refused(self, err: Exception) -> None:
        """A run refused at its start (a bad data file, column, reward function...) still
        leaves metrics.json saying why, unless an earlier run's is there (never lost)."""
        if not (self.out / "metrics.json").exists():
            RunRecord(config=as_dict(self.cfg)).write(
                self.out, {"failed": f"{type(err).__name__}: {err}"})

    async def start(self, checkpoint: Path | None = None) -> None:
        """Start the runtime and both services; the trainer loads `checkpoint` when given;
        then the generator gets the trainer's weights."""
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
        # a lost trainer proc restarts the trainer's whole group, whose services come back
        # in the same processes as before, and the loop reloads its last checkpoint
        # (`recovery.Recovery`); with run.max_restarts=0 the trainer does not come back: a trainer
        # back at step 0 would be a silent restart
        self.recovery = Recovery(self, group_restarts(groups[0]))
        restart = {"restart": "group"} if run.max_restarts else {"respawn": False}
        self.trainer = await spawn_service(
            ServiceConfig(procs_per_host=run.slots, resource_group=groups[0], **restart),
            TrainerActor, path, lr=self.cfg.grpo.lr,
            max_grad_norm=self.cfg.grpo.max_grad_norm, name="trainer",
            **vars(self.cfg.trainer))
        config, options = self._generator_service(groups[1], restart)
        self.generator = await spawn_service(config, GeneratorActor, path,
                                             name="generator", **options)
        self.generator.on_respawn.append(self._resync)
        if self.cfg.grpo.beta > 0:
            self.reference = await spawn_reference(self.cfg, path, groups[0], restart)
        await self.load(checkpoint)

    async def load(self, checkpoint: Path | None) -> None:
        """The trainer loads `checkpoint` (None: it keeps the weights it has), then the
        generator gets the trainer's weights (and ends awake)."""
        if checkpoint is not None:
            async with phase(self.trainer):
                await self.trainer.load_checkpoint.route(str(checkpoint / "trainer"))
        await sync_weights(self.trainer, self.generator)

    def _generator_service(self, group: str, restart: dict[str, Any]
                           ) -> tuple[ServiceConfig, dict[str, Any]]:
        """The generator's service config and engine options. The torch engine: one
        replica per slot; vLLM on several slots: one replica over all of them (tp x dp
        ranks, called SPMD), the node-scale hybrid engine. Beside the trainer it takes the
        trainer's restart policy (one per group); on slots of its own, a lost replica is
        respawned alone and given the weights (`_resync`)."""
        run, options = self.cfg.run, {"engine": self.cfg.run.engine}
        shared = run.colocate and restart.get("restart") == "group"
        shape = {"resource_group": group, **(restart if shared else {})}
        if run.engine == "torch":
            # every wake comes with the trainer's weights (a sync): keep none across sleeps
            config = ServiceConfig(num_replicas=run.slots, **shape)
            options["keep_weights"] = False
        elif run.slots == 1:
            config = ServiceConfig(**shape)
        else:
            tp = self.cfg.generator.tensor_parallel_size
            config = ServiceConfig(procs_per_host=run.slots, **shape)
            options.update(tensor_parallel_size=tp, data_parallel_size=run.slots // tp)
        return config, options

    async def _resync(self, replica: Replica) -> None:
        """A generator replica came back from a failure with the initial weights: give it
        the trainer's before it takes a call (never while a train step or a sync runs)."""
        async with self.training:
            await sync_weights(self.trainer, self.generator, [replica])
        self.resyncs += 1

    async def stop(self) -> None:
        self.source.close()
        await self.rm.shutdown()

    async def _readings(self, label: str) -> None:
        """Mark a phase switch and record what each side holds now."""
        self.record.phase(label)
        self.postfix["phase"] = label
        if self.bar is not None:  # shown now: the bar otherwise redraws only at a step's end
            self.bar.set_postfix(self.postfix)
        readings = {name: await resident_per_proc(service)
                    for name, service in self.services().items()}
        now = self.record.now()
        for name, per_proc in readings.items():
            self.record.reading(name, sum(per_proc.values()), now)
        self.peaks.add(readings)

    def services(self) -> dict[str, Service]:
        """The run's services by tenant name."""
        named = {"trainer": self.trainer, "generator": self.generator}
        return named if self.reference is None else {**named, "reference": self.reference}

    async def generate(self, prompts: list[Row], params: SamplingParams, copies: int
                       ) -> tuple[list[list[int]], list]:
        """`copies` completions per prompt, spread over the generator's replicas."""
        tokens = [p.tokens for p in prompts for _ in range(copies)]
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

    async def evaluate(self, where: str = "the evaluation") -> float:
        """The mean reward of greedy completions of the held-out prompts (those the reward
        functions gave none left out)."""
        rows = self.source.eval_rows()
        _, completions = await self.generate(rows, self.greedy, 1)
        texts = [self.decode(c.tokens) for c in completions]
        scored = await self.source.score(where, rows, texts, completions)
        rewards = [v for v in scored.values if v is not None]
        if not rewards:
            logger.warning("%s: no eval prompt got a reward: eval reward 0", where)
            return 0.0
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
            prompts = self.source.sample(cfg.grpo.prompts_per_step)
            sampling = dataclasses.replace(self.sampling,
                                           seed=cfg.run.seed * 1_000_003 + index * 10_007)
            tokens, completions = await self.generate(prompts, sampling,
                                                      cfg.grpo.group_size)
        generated = clock()
        # the next tenant's wake needs nothing from the scores: it runs while they are
        # computed, decoding and the batch on a worker thread so that this loop drives it
        ahead = asyncio.ensure_future(self._switch_ahead(
            self.trainer if self.reference is None else self.reference))
        try:
            rows = [p for p in prompts for _ in range(cfg.grpo.group_size)]
            texts = await asyncio.to_thread(lambda: [self.decode(c.tokens)
                                                     for c in completions])
            result = await self.source.score(f"step {index}", rows, texts, completions)
            batch, stats = await asyncio.to_thread(scored_batch, tokens, completions, result,
                                                   cfg.grpo, self.pad_id)
        except BaseException:
            _drop(ahead)
            raise
        scored = referenced = ref_woken = referencing = clock()
        if self.reference is not None:  # its turn: woken for the reference log-probs
            ahead_s = await ahead  # its error, if it failed, is raised here
            async with phase(self.reference):  # awake already: no switch
                ref_woken = clock()
                await self._readings("reference")
                referencing = clock()
                batch["ref_logprobs"] = await self.reference.forward.route(
                    ReferenceLogprobs(cfg.grpo.temperature), batch)
                referenced = clock()
        async with self.training:
            if self.reference is None:
                ahead_s = await ahead  # its error, if it failed, is raised here
            async with phase(self.trainer):  # no switch unless the reference took its turn
                trainer_woken = clock()
                await self._readings("train")
                training = clock()
                for _ in range(cfg.grpo.updates_per_batch):
                    metrics = await self.trainer.train_step.route(GRPOLoss(self.grpo), batch)
                trained = clock()
                await self._keep(index + 1)
                kept = clock()
            await sync_weights(self.trainer, self.generator)
        synced = clock()
        await self._readings("sync")
        readings = (generating - woken) + (referencing - ref_woken) + (training - trainer_woken)
        row = {"step": index, **stats, **metrics,
               "generate_s": generated - generating, "score_s": scored - generated,
               "reference_s": referenced - referencing, "reference_switch_s": ref_woken - scored,
               "train_s": trained - training, "save_s": kept - trained,
               "switch_s": (woken - start) + (ref_woken - scored) + (trainer_woken - referenced),
               "switch_ahead_s": ahead_s,
               "sync_s": synced - kept, "step_s": synced - start - readings,
               "readings_s": readings + (clock() - synced)}
        if (index + 1) % cfg.run.eval_every == 0 or index + 1 == cfg.run.steps:
            row["eval_reward"] = await self.evaluate(f"the evaluation after step {index}")
        return row

    async def _switch_ahead(self, target: Service) -> float:
        """Wake `target`, the step's next phase, while the completions are scored; returns
        how long the switch took (the step waits only for what is left of it)."""
        began = time.monotonic()
        async with phase(target):  # it stays awake after: the step's own phase is free
            pass
        return time.monotonic() - began

    def _saves(self, done: int) -> bool:
        """Whether the loop keeps a checkpoint after `done` steps."""
        every = self.cfg.run.save_every
        return every > 0 and (done % every == 0 or done == self.cfg.run.steps)

    async def _keep(self, done: int) -> None:
        """While the trainer is awake after its `done`-th step: start its checkpoint (the
        loop's state joins it once the step's metrics are in) and export the model when
        `run.export_every` says so."""
        if self._saves(done):
            path = self.checkpoints.path(done)
            shutil.rmtree(path, ignore_errors=True)  # what a killed run left half-written
            path.mkdir(parents=True)
            await self.trainer.save_checkpoint.route(str(path / "trainer"),
                                                     wait=self.save_waits)
        every = self.cfg.run.export_every
        if every and done % every == 0:
            await self.trainer.export_model.route(str(self.out / "model"))

    def _keep_loop_state(self, done: int) -> None:
        """The loop's side of the checkpoint after `done` steps, then the old ones pruned."""
        if not self._saves(done):
            return
        LoopState(step=done, sampler=self.sampler.state_dict(),
                  identity=identity(self.record.config), metrics=self.record.steps,
                  memory=self.record.memory, phases=self.record.phases,
                  restarts=self.record.restarts, elapsed_s=self.record.now(),
                  ).write(self.checkpoints.path(done) / "loop.json")
        self.checkpoints.prune()

    def _resume(self) -> tuple[Path, LoopState] | None:
        """The checkpoint to go on from (`run.resume`), its loop state restored here."""
        found = find_resume(self.cfg.run.resume, self.checkpoints, self.record.config)
        if found is None:
            if self.cfg.run.resume == "none" and (removed := self.checkpoints.clear()):
                logger.warning("run.resume=none: removed %d checkpoint(s) of an earlier run "
                               "under %s", removed, self.checkpoints.root)
            return None
        path, state = found
        self.sampler.load_state_dict(state.sampler)
        self.record.resume(state)
        return path, state

    async def run(self) -> dict[str, Any]:
        """Train up to `run.steps` steps (from the checkpoint `run.resume` names, if any),
        export the model, write the plots and metrics.json (also, with what was done and
        the error, when the run fails) and return the summary."""
        lock = RunLock(self.out)
        try:
            return await self._run()
        finally:
            lock.release()

    async def _run(self) -> dict[str, Any]:
        resumed = self._resume()
        first_step = 0 if resumed is None else resumed[1].step
        if first_step > self.cfg.run.steps:
            raise ValueError(f"run.steps={self.cfg.run.steps}: the checkpoint {resumed[0]} "
                             f"is already at step {first_step}; give run.steps >= that")
        await self.start(None if resumed is None else resumed[0])
        devices = {name: await devices_of(service) for name, service in self.services().items()}
        try:
            await self._train(first_step)
            async with phase(self.trainer):  # the last save finishes; the model goes out
                await self.trainer.wait_checkpoint.route()
                await self.trainer.export_model.route(str(self.out / "model"))
            self.checkpoints.prune()
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
            "devices": devices,  # where each service ran: "cpu", or its GPUs' UUIDs
            "generator_respawns": self.resyncs,
            "resumed_at": first_step or None,
            "restarts": len(self.record.restarts),
            **self.source.summary,
        }
        if self.reference is not None:
            # the reference's turn: its forward pass and the one more switch it takes
            summary["reference_share"] = sum(s["reference_s"] + s["reference_switch_s"]
                                             for s in steps) / sum(s["step_s"] for s in steps)
            summary["memory_per_proc"] = self.peaks.summary()
        self.record.write(self.out, summary)
        return summary

    async def _train(self, first_step: int) -> None:
        """Steps `first_step` to run.steps - 1 (from 0: after the untrained evaluation)."""
        await self._readings("start")
        if first_step == 0:
            async with phase(self.generator):
                untrained = await self.evaluate("the untrained evaluation")
            self.record.step({"step": -1, "reward": None, "eval_reward": untrained})
        evals = [s["eval_reward"] for s in self.record.steps if "eval_reward" in s]
        self.postfix["eval"] = f"{evals[-1]:.2f}"
        self.bar = tqdm(desc="GRPO", initial=first_step, total=self.cfg.run.steps)
        index = first_step
        while index < self.cfg.run.steps:
            try:
                row = await self.recovery.run(self.step(index))
            except (Exception, asyncio.CancelledError) as failure:
                index = await self.recovery.recover(index, failure)
                self.bar.n = index
                self.bar.refresh()
                continue
            index += 1
            self.bar.update()
            self.record.step(row)
            self._keep_loop_state(index)
            self.postfix["reward"] = f"{row['reward']:.2f}"
            if "eval_reward" in row:
                self.postfix["eval"] = f"{row['eval_reward']:.2f}"
            self.bar.set_postfix(self.postfix, refresh=False)
        self.bar.close()


def _drop(task: asyncio.Future) -> None:
    """End a switch started ahead for a step that failed before it was needed (its error,
    if any, is the step's failure's consequence: retrieved here, not logged)."""
    task.cancel()
    task.add_done_callback(lambda done: done.cancelled() or done.exception())
