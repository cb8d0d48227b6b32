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
(`saves.py`), the step's clock (`timing.py`), the run's summary (`summary.py`), and the
run's plan, made as it starts and checked in its summary (`plan.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from pathlib import Path
from typing import Any

from tqdm import tqdm

from colocate import phase
from colocate.engines.models import load_tokenizer
from colocate.engines.sampling import SamplingParams
from examples.rl_loop.batch import ReferenceLogprobs, losses, scored_batch
from examples.rl_loop.budget import budget_summary
from examples.rl_loop.config import RLConfig, as_dict
from examples.rl_loop.envs import Environments
from examples.rl_loop.episodes import AgentRollouts
from examples.rl_loop.hooks import Hooks
from examples.rl_loop.host_memory import host_capacity, host_readings, host_summary
from examples.rl_loop.memory import ProcPeaks, devices_of, resident_per_proc
from examples.rl_loop.partial import PartialRollouts
from examples.rl_loop.partial_episodes import PartialAgentRollouts
from examples.rl_loop.plan import plan_check, plan_for_run
from examples.rl_loop.record import RunRecord
from examples.rl_loop.recovery import Recovery
from examples.rl_loop.rollouts import Rollout, Rollouts
from examples.rl_loop.runtime import Runtime, drop, model_dir, switch_ahead
from examples.rl_loop.saves import Saves
from examples.rl_loop.sources import Scored, check_fits, make_source, max_positions
from examples.rl_loop.state import RunLock
from examples.rl_loop.summary import summarize
from examples.rl_loop.timing import StepClock
from examples.rl_loop.tools import tool_schemas
from examples.rl_loop.transcripts import make_transcript
from services import Service, sync_weights

logger = logging.getLogger(__name__)


class Loop:
    """One run: the runtime and its services (`runtime.Runtime`), the task (`sources`), the
    rollouts (`rollouts`), the checkpoints (`saves.Saves`), what is recorded, and the
    caller's `hooks`."""

    def __init__(self, cfg: RLConfig, hooks: Hooks | None = None) -> None:
        self.cfg, self.out = cfg, Path(cfg.run.out)
        self.hooks = hooks or Hooks()
        self.hooks.loop = self
        try:
            # the prompts and the reward functions first: a bad file, column or function is
            # refused before anything is built
            self.source = make_source(cfg)
            self.model_dir = model_dir(cfg, self.out, self.source.alphabet)
            self.tokenizer = load_tokenizer(self.model_dir)  # checks the directory first
            self.source.prepare(self.tokenizer)
            check_fits(self.source, self.model_dir, cfg.served_positions)
            self.rollouts = self._rollouts()
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
        self.record = RunRecord(config=as_dict(cfg), logdir=self.out / "tensorboard",
                                wandb_dir=self.out if cfg.run.wandb else None)
        self.recovery = Recovery(self)  # going on after a lost proc
        self.runtime = Runtime(cfg, self.model_dir, self.recovery)
        self.saves = Saves(cfg, self.out, self.record, self.sampler, self.rollouts,
                           lambda: self.runtime.trainer)
        self.bar: tqdm | None = None
        self.peaks = ProcPeaks()
        self.host_capacity: int | None = None  # the hosts' for backups, read at start
        self.postfix: dict[str, str] = {}  # the progress bar's reward, eval and phase
        self.eval_metrics: dict[str, Any] = {}  # the last evaluation's, per reward function
        self.greedy = SamplingParams(max_new_tokens=self.source.max_new_tokens, temperature=0,
                                     stop_token_ids=(self.tokenizer.eos_token_id,))

    def _rollouts(self) -> Rollouts:
        """The rollouts of `rollout.mode`, drawing from the source and sampling with each
        step's seed (the sync ones with the loop's scoring, for dynamic sampling)."""
        cfg = self.cfg
        positions = max_positions(self.model_dir, cfg.served_positions)
        parts = (self.source, lambda tokens, params: self.runtime.generate_ids(tokens, params),
                 self.sampling, cfg.grpo, cfg.generator.max_batch)
        if cfg.rollout.partial and not (cfg.tools.used or cfg.env.used):
            return PartialRollouts(*parts, cfg.rollout, positions)
        score = functools.partial(self._score, copies=cfg.grpo.group_size)
        if cfg.tools.used or cfg.env.used:
            transcript = make_transcript(self.tokenizer, tool_schemas(cfg.tools),
                                         cfg.rollout.tool_format)
            envs = Environments(cfg.env, cfg.data.prompt_key) if cfg.env.used else None
            turns = lambda *args: self.runtime.generate_turns(*args)  # noqa: E731
            agent = AgentRollouts(*parts, cfg.rollout, transcript, lambda: self.runtime.tools,
                                  positions, turns, score, envs)
            if cfg.rollout.partial:  # the episodes are the pool's items
                return PartialAgentRollouts(parts[0], turns, *parts[2:], cfg.rollout,
                                            positions, agent)
            return agent
        return Rollouts(*parts, score)

    def _refused(self, err: Exception) -> None:
        """A run refused at its start (a bad data file, column, reward function...) still
        leaves metrics.json saying why, unless an earlier run's is there (never lost)."""
        if not (self.out / "metrics.json").exists():
            RunRecord(config=as_dict(self.cfg)).write(
                self.out, {"failed": f"{type(err).__name__}: {err}"})

    @property
    def trainer(self) -> Service:
        return self.runtime.trainer

    @property
    def generator(self) -> Service:
        return self.runtime.generator

    async def start(self, checkpoint: Path | None = None) -> None:
        """Start the runtime and the services (the trainer loads `checkpoint` when given)."""
        await self.runtime.start(checkpoint)
        self.host_capacity = await host_capacity(self.runtime.rm)
        await self.hooks.started()

    async def load(self, checkpoint: Path | None) -> None:
        """After a restart: the trainer loads `checkpoint`, the generator gets its weights."""
        await self.hooks.loading(checkpoint)
        await self.runtime.load(checkpoint)

    async def stop(self) -> None:
        await self.hooks.stopping()
        self.source.close()
        await self.runtime.stop()

    async def mark(self, label: str, clock: StepClock | None = None) -> None:
        """Enter phase `label` (the hooks', the record's, the progress bar's) and record what
        each side holds now (the time it takes goes to `clock`'s readings); then the hooks'
        `phase`, right before the phase's calls."""
        self.record.phase(label)
        self.postfix["phase"] = label
        if self.bar is not None:  # shown now: the bar otherwise redraws only at a step's end
            self.bar.set_postfix(self.postfix)
        services = self.runtime.services()
        readings = {name: await resident_per_proc(service)
                    for name, service in services.items()}
        now = self.record.now()
        for name, per_proc in readings.items():
            self.record.reading(name, sum(per_proc.values()), now)
        self.peaks.add(readings)
        if clock is not None:
            clock.lap("readings")
        await self.hooks.phase(label)

    def decode(self, tokens: list[int]) -> str:
        """A completion's text, without special tokens (the stop token among them)."""
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    async def evaluate(self, where: str = "the evaluation") -> float:
        """The mean reward of greedy completions of the held-out prompts (those the reward
        functions gave none left out)."""
        rollout = await self.rollouts.episodes(self.source.eval_rows(), self.greedy, 1)
        scored = await self._score(where, rollout, 1)
        self.eval_metrics = {k: v for k, v in scored.metrics.items() if k.startswith("rewards/")}
        rewards = [v for v in scored.values if v is not None]
        if not rewards:
            logger.warning("%s: no eval prompt got a reward: eval reward 0", where)
            return 0.0
        return sum(rewards) / len(rewards)

    async def step(self, index: int) -> dict[str, Any]:
        """One GRPO step: generate, score, (reference log-probs), train, save, sync. Returns
        its metrics and where its time went (`timing.StepClock`)."""
        cfg, rt, clock = self.cfg, self.runtime, StepClock()
        async with phase(rt.generator):  # no switch: the last sync left it awake
            clock.lap("generator_switch")
            await self.mark("generate", clock)
            rollout = await self.rollouts.generate(index)
        clock.lap("generate")
        # beside the scoring: the next step's first round (rollout.overlap; first, where the
        # slots cannot hold it beside the trainer), then the next tenant's wake
        await self.rollouts.start_next(index + 1, self._generating, self._side_by_side())
        ahead = switch_ahead(rt.trainer if rt.reference is None else rt.reference)
        try:
            batch, stats, is_cap = await self._scored(index, rollout)
            clock.lap("score")
            if rt.reference is not None:  # its turn: woken for the reference log-probs
                ahead_s = await ahead  # its error, if it failed, is raised here
                async with phase(rt.reference):  # awake already: no switch
                    clock.lap("reference_switch")
                    await self.mark("reference", clock)
                    batch["ref_logprobs"] = await rt.reference.forward.route(
                        ReferenceLogprobs(cfg.grpo.temperature), batch)
                    clock.lap("reference")
            async with rt.training:
                if rt.reference is None:
                    ahead_s = await ahead
                async with phase(rt.trainer):  # no switch unless the reference took its turn
                    clock.lap("switch")
                    await self.mark("train", clock)
                    for loss in losses(self.grpo, cfg.grpo.updates_per_batch, is_cap):
                        metrics = await rt.trainer.train_step.route(loss, batch)
                    beside = await self.rollouts.before_sync()  # before the weights change
                    clock.lap("train")
                    saved = await self.hooks.save(index + 1,
                                                  lambda: self.saves.after_step(index + 1))
                    clock.lap("save")
                await self.hooks.sync(lambda: sync_weights(rt.trainer, rt.generator))
                self.rollouts.synced()
        except BaseException:  # what was started ahead is not needed any more
            drop(ahead)
            self.rollouts.drop()
            raise
        clock.lap("sync")
        await self.mark("sync", clock)
        moves = await rt.moves.since_last(rt.services())  # what the switches moved
        moves.update(await host_readings(rt.rm))  # and what the backups held so far
        clock.lap("readings")
        row = {"step": index, **stats, **metrics, **clock.metrics(switch_ahead_s=ahead_s),
               **moves, **rollout.metrics, **beside, **saved}
        row["samples_per_s"] = row["finished_samples"] / row["step_s"]
        if (index + 1) % cfg.run.eval_every == 0 or index + 1 == cfg.run.steps:
            row["eval_reward"] = await self.evaluate(f"the evaluation after step {index}")
            row.update({f"eval/{k}": v for k, v in self.eval_metrics.items()})
        return row

    def sampling(self, index: int) -> SamplingParams:
        """Step `index`'s sampling, with its seed."""
        return SamplingParams(max_new_tokens=self.source.max_new_tokens,
                              temperature=self.cfg.grpo.temperature,
                              stop_token_ids=(self.tokenizer.eos_token_id,),
                              seed=self.cfg.run.seed * 1_000_003 + index * 10_007)

    def _side_by_side(self) -> bool:
        """Whether the generator's calls can run beside the trainer's: on slots of their own
        (`run.colocate=false`), or on roomy ones (every tenant awake, all their working
        memories fitting at once)."""
        rm = self.runtime.rm
        return not self.cfg.run.colocate or all(
            rm.roomy_for(name) for name in self.runtime.generator.tenant_names())

    async def _generating(self, prompts: list[list[int]], params: SamplingParams,
                          *turns: Any) -> list:
        """`generate_ids` (given episodes' sessions and stickiness, `turns`: the
        `generate_turns` of episodes) in the generator's phase (a round started while a
        step trains)."""
        async with phase(self.runtime.generator):
            if turns:
                return await self.runtime.generate_turns(prompts, params, *turns)
            return await self.runtime.generate_ids(prompts, params)

    async def _scored(self, index: int, rollout: Rollout
                      ) -> tuple[dict[str, Any], dict[str, Any], float | None]:
        """Step `index`'s rollout scored by the reward functions: the training batch
        (group-relative advantages), its statistics and its importance weight's cap; a
        rollout that comes scored (dynamic sampling) is not scored again."""
        result = rollout.scored
        if result is None:
            result = await self._score(f"step {index}", rollout, self.cfg.grpo.group_size)
        batch, stats = await asyncio.to_thread(scored_batch, rollout.tokens,
                                               rollout.completions, result, self.cfg.grpo,
                                               self.pad_id)
        return batch, stats, self.rollouts.finish_batch(rollout, batch)

    async def _score(self, where: str, rollout: Rollout, copies: int) -> Scored:
        """The reward functions' scores of `rollout` (`copies` samples a row), with what the
        rollouts add to each (a bad tool call's penalty)."""
        rows = [row for row in rollout.rows for _ in range(copies)]
        texts = await asyncio.to_thread(
            lambda: [self.decode(c.tokens) for c in rollout.completions])
        scored = await self.source.score(where, rows, texts, rollout.completions,
                                         rollout.conversations)
        if rollout.extra_rewards is not None:
            scored.values = [None if v is None else v + extra for v, extra
                             in zip(scored.values, rollout.extra_rewards, strict=True)]
        return scored

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
        saves = self.saves
        resumed = saves.resume()
        first_step = 0 if resumed is None else resumed[1].step
        if first_step > self.cfg.run.steps:
            raise ValueError(f"run.steps={self.cfg.run.steps}: the checkpoint {resumed[0]} "
                             f"is already at step {first_step}; give run.steps >= that")
        plan = plan_for_run(self.cfg, self.model_dir, self.out)  # checked at the end
        await self.start(None if resumed is None else resumed[0])
        rt = self.runtime
        devices = {name: await devices_of(service) for name, service in rt.services().items()}
        try:
            await self._train(first_step)
            async with phase(rt.trainer):  # the last save finishes; the model goes out
                await saves.at_end(self.cfg.run.steps)
                await rt.trainer.export_model.route(str(self.out / "model"))
            saves.checkpoints.prune()
        except BaseException as err:
            found = saves.checkpoints.complete()
            err.add_note(f"the last complete checkpoint: {found[-1]} (run.resume=auto goes on "
                         "from it)" if found else "no complete checkpoint yet: "
                         "run.resume=auto starts the run anew")
            self.record.write(self.out, {"failed": f"{type(err).__name__}: {err}; "
                                                   f"{err.__notes__[-1]}"})
            raise
        finally:
            await self.stop()
        summary = summarize(self.record.steps, engine=self.cfg.run.engine, devices=devices,
                            generator_respawns=rt.resyncs, resumed_at=first_step or None,
                            restarts=len(self.record.restarts), task=self.source.summary,
                            peaks=None if rt.reference is None else self.peaks,
                            budget={**budget_summary(self.cfg, rt.arbiter, self.model_dir),
                                    **host_summary(self.record.steps, self.host_capacity)})
        summary["plan"] = plan_check(plan, self.record.steps[1:], summary,
                                     rt.reference is not None)
        for off in summary["plan"]["off"]:
            logger.warning("the run's plan is off: %s", off)
        if saves.write_failures:  # each saved again at once (`saves.py`)
            summary["checkpoint_write_failures"] = [
                {k: v for k, v in failure.items() if k != "detected_at"}
                for failure in saves.write_failures]
        self.record.write(self.out, summary)
        return summary

    async def _train(self, first_step: int) -> None:
        """Steps `first_step` to run.steps - 1 (from 0: after the untrained evaluation)."""
        await self.mark("start")
        if first_step == 0:
            async with phase(self.runtime.generator):
                untrained = await self.evaluate("the untrained evaluation")
            self.record.step({"step": -1, "reward": None, "eval_reward": untrained,
                              **{f"eval/{k}": v for k, v in self.eval_metrics.items()}})
        evals = [s["eval_reward"] for s in self.record.steps if "eval_reward" in s]
        self.postfix["eval"] = f"{evals[-1]:.2f}"
        self.bar = tqdm(desc="GRPO", initial=first_step, total=self.cfg.run.steps)
        index = first_step
        while index < self.cfg.run.steps:
            try:
                await self.hooks.step_began(index)
                row = await self.recovery.run(self.step(index))
            except (Exception, asyncio.CancelledError) as failure:
                index = await self.recovery.recover(index, failure)
                self.bar.n = index
                self.bar.refresh()
                continue
            await self.hooks.step_ended(index, row)
            index += 1
            self.bar.update()
            self.record.step(row)
            self.saves.write_loop_state(index)
            self.postfix["reward"] = f"{row['reward']:.2f}"
            if "eval_reward" in row:
                self.postfix["eval"] = f"{row['eval_reward']:.2f}"
            self.bar.set_postfix(self.postfix, refresh=False)
        self.bar.close()
