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

Around the step: the runtime and the services (`runtime.py`), the checkpoints
(`saves.py`), the step's clock (`timing.py`), the run's summary (`summary.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path
from typing import Any

from tqdm import tqdm

from colocate import phase
from colocate.engines.models import load_tokenizer
from colocate.engines.sampling import SamplingParams
from examples.rl_loop.budget import budget_summary
from examples.rl_loop.config import RLConfig, as_dict
from examples.rl_loop.data import Row
from examples.rl_loop.memory import ProcPeaks, devices_of, resident_per_proc
from examples.rl_loop.partial import Pool, check_room, decode_slots, generate_step, prefetch
from examples.rl_loop.record import RunRecord
from examples.rl_loop.recovery import Recovery
from examples.rl_loop.rollouts import ReferenceLogprobs, behind, losses, scored_batch
from examples.rl_loop.runtime import Runtime, drop, model_dir, switch_ahead
from examples.rl_loop.saves import Saves
from examples.rl_loop.sources import check_fits, make_source
from examples.rl_loop.state import Checkpoints, RunLock
from examples.rl_loop.summary import summarize
from examples.rl_loop.timing import StepClock
from services import sync_weights

logger = logging.getLogger(__name__)


class Loop(Runtime, Saves):
    """One run: the runtime and the services (trainer, generator and, with grpo.beta > 0,
    the reference: `runtime.Runtime`), the task, the checkpoints (`saves.Saves`), and what
    is recorded."""

    def __init__(self, cfg: RLConfig) -> None:
        super().__init__(cfg)
        self.out = Path(cfg.run.out)
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
        self.write_failures = []  # checkpoint writes that failed, each saved again (`saves`)
        self.record = RunRecord(config=as_dict(cfg), logdir=self.out / "tensorboard",
                                wandb_dir=self.out if cfg.run.wandb else None)
        self.recovery = Recovery(self)  # going on after a lost proc (`start` has it follow)
        self.bar: tqdm | None = None
        self.peaks = ProcPeaks()
        self.postfix: dict[str, str] = {}  # the progress bar's reward, eval and phase
        self.sampling = SamplingParams(max_new_tokens=self.source.max_new_tokens,
                                       temperature=cfg.grpo.temperature,
                                       stop_token_ids=(self.tokenizer.eos_token_id,))
        self.greedy = SamplingParams(max_new_tokens=self.source.max_new_tokens, temperature=0,
                                     stop_token_ids=(self.tokenizer.eos_token_id,))
        self.pool = None  # rollout.mode=partial: the carried samples (`partial.Pool`)
        if cfg.rollout.partial:
            longest = (self.source.longest_prompt() if hasattr(self.source, "longest_prompt")
                       else len(self.encode("0" * cfg.task.max_digits + ">")))
            check_room(longest, self.source.max_new_tokens, cfg.rollout.max_tokens_per_step,
                       self.model_dir)
            self.pool = Pool(cfg.rollout, cfg.grpo.group_size, self.source.max_new_tokens,
                             cfg.generator.max_batch)

    def _refused(self, err: Exception) -> None:
        """A run refused at its start (a bad data file, column, reward function...) still
        leaves metrics.json saying why, unless an earlier run's is there (never lost)."""
        if not (self.out / "metrics.json").exists():
            RunRecord(config=as_dict(self.cfg)).write(
                self.out, {"failed": f"{type(err).__name__}: {err}"})

    async def stop(self) -> None:
        self.source.close()
        await super().stop()

    async def _readings(self, label: str, clock: StepClock | None = None) -> None:
        """Mark a phase switch and record what each side holds now (the time it takes goes
        to `clock`'s readings)."""
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
        if clock is not None:
            clock.lap("readings")

    def encode(self, text: str) -> list[int]:
        """A prompt's token ids, with the special tokens the model's tokenizer adds."""
        return self.tokenizer(text).input_ids

    def decode(self, tokens: list[int]) -> str:
        """A completion's text, without special tokens (the stop token among them)."""
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

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
        """One GRPO step; returns its metrics and where its time went (`timing.StepClock`;
        the memory readings taken for the plots are timed apart, `readings_s`)."""
        cfg, clock = self.cfg, StepClock()
        async with phase(self.generator):  # no switch: the last sync left it awake
            clock.lap("switch")
            await self._readings("generate", clock)
            # with rollout.overlap the last step drew this one's prompts (`partial.prefetch`)
            prompts = [] if self.pool is not None and self.pool.has(index) \
                else self.source.sample(cfg.grpo.prompts_per_step)
            sampling = self._sampling(index)
            if self.pool is None:
                tokens, completions = await self.generate(prompts, sampling,
                                                          cfg.grpo.group_size)
                lengths = [len(c.tokens) for c in completions]
                rollout = {"finished_samples": len(completions),
                           "gen_idle_share": 1 - sum(lengths) / max(1, decode_slots(
                               lengths, cfg.generator.max_batch))}
            else:  # partial: a token budget, the unfinished samples carried over
                self.pool.add(prompts, index)
                groups, rollout = await generate_step(self.pool, self.generate_ids, sampling)
                prompts = [g.row for g in groups]
                completions = [s.completion() for g in groups for s in g.samples]
                tokens = [g.row.tokens for g in groups for _ in g.samples]
        clock.lap("generate")
        # the next tenant's wake needs nothing from the scores: it runs while they are
        # computed, decoding and the batch on a worker thread so that this loop drives it
        ahead = switch_ahead(self.trainer if self.reference is None else self.reference)
        prefetched = prefetch(self.pool, self.source.sample(cfg.grpo.prompts_per_step),
                              index + 1, self._generating, self._sampling(index + 1)) \
            if cfg.rollout.overlap else None  # the next step's first round, meanwhile
        try:
            batch, stats = await self._scored(index, prompts, tokens, completions)
            is_cap = None
            if self.pool is not None:  # how many versions older than the trainer's each token is
                batch["behind"] = behind(tokens, completions, self.pool.version, batch["mask"])
                is_cap = cfg.rollout.is_cap if bool(batch["behind"].any()) else None
            clock.lap("score")
            if self.reference is not None:  # its turn: woken for the reference log-probs
                ahead_s = await ahead  # its error, if it failed, is raised here
                async with phase(self.reference):  # awake already: no switch
                    clock.lap("reference_switch")
                    await self._readings("reference", clock)
                    batch["ref_logprobs"] = await self.reference.forward.route(
                        ReferenceLogprobs(cfg.grpo.temperature), batch)
                    clock.lap("reference")
            async with self.training:
                if self.reference is None:
                    ahead_s = await ahead  # its error, if it failed, is raised here
                async with phase(self.trainer):  # no switch unless the reference took its turn
                    clock.lap("switch")
                    await self._readings("train", clock)
                    for loss in losses(self.grpo, cfg.grpo.updates_per_batch, is_cap):
                        metrics = await self.trainer.train_step.route(loss, batch)
                    if prefetched is not None:  # its tokens are this version's: in before the sync
                        rollout["prefetched_tokens"] = (await prefetched.absorb())["tokens"]
                    clock.lap("train")
                    saved = await self._keep(index + 1)
                    clock.lap("save")
                await sync_weights(self.trainer, self.generator)
                if self.pool is not None:
                    self.pool.version += 1  # the generator's weights: one training step newer
        except BaseException:  # what was started ahead is not needed any more
            drop(ahead)
            if prefetched is not None:
                drop(prefetched.task)
            raise
        clock.lap("sync")
        await self._readings("sync", clock)
        moves = await self.moves.since_last(self.services())  # what the switches moved
        clock.lap("readings")
        row = {"step": index, **stats, **metrics, **clock.metrics(switch_ahead_s=ahead_s),
               **moves, **rollout, **saved}
        row["samples_per_s"] = row["finished_samples"] / row["step_s"]
        if (index + 1) % cfg.run.eval_every == 0 or index + 1 == cfg.run.steps:
            row["eval_reward"] = await self.evaluate(f"the evaluation after step {index}")
        return row

    def _sampling(self, index: int) -> SamplingParams:
        """Step `index`'s sampling, with its seed."""
        return dataclasses.replace(self.sampling,
                                   seed=self.cfg.run.seed * 1_000_003 + index * 10_007)

    async def _generating(self, prompts: list[list[int]], params: SamplingParams) -> list:
        """`generate_ids` in the generator's phase (a round started while a step trains)."""
        async with phase(self.generator):
            return await self.generate_ids(prompts, params)

    async def _scored(self, index: int, prompts: list[Row], tokens: list[list[int]],
                      completions: list) -> tuple[dict[str, Any], dict[str, Any]]:
        """Step `index`'s completions scored by the reward functions: the training batch
        (group-relative advantages) and its statistics."""
        rows = [p for p in prompts for _ in range(self.cfg.grpo.group_size)]
        texts = await asyncio.to_thread(lambda: [self.decode(c.tokens) for c in completions])
        result = await self.source.score(f"step {index}", rows, texts, completions)
        return await asyncio.to_thread(scored_batch, tokens, completions, result,
                                       self.cfg.grpo, self.pad_id)

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
                await self._last_save(self.cfg.run.steps)
                await self.trainer.export_model.route(str(self.out / "model"))
            self.checkpoints.prune()
        except BaseException as err:
            found = self.checkpoints.complete()
            err.add_note(f"the last complete checkpoint: {found[-1]} (run.resume=auto goes on "
                         "from it)" if found else "no complete checkpoint yet: "
                         "run.resume=auto starts the run anew")
            self.record.write(self.out, {"failed": f"{type(err).__name__}: {err}; "
                                                   f"{err.__notes__[-1]}"})
            raise
        finally:
            await self.stop()
        summary = summarize(self.record.steps, engine=self.cfg.run.engine, devices=devices,
                            generator_respawns=self.resyncs, resumed_at=first_step or None,
                            restarts=len(self.record.restarts), task=self.source.summary,
                            peaks=None if self.reference is None else self.peaks,
                            budget=budget_summary(self.cfg, self.arbiter, self.model_dir))
        if self.write_failures:  # each saved again at once (`saves.py`)
            summary["checkpoint_write_failures"] = [
                {k: v for k, v in failure.items() if k != "detected_at"}
                for failure in self.write_failures]
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

