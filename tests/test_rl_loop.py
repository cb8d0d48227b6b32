"""The RL loop example end to end on Monarch procs: it learns, and it writes its plots."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import sys
from pathlib import Path

import psutil
import pytest

from colocate.engines.tiny import write_tiny_model
from examples.rl_loop.config import load_config
from examples.rl_loop.hooks import Hooks
from examples.rl_loop.loop import Loop
from examples.rl_loop.sources import DigitTask
from services.errors import ServiceUnavailableError

pytestmark = pytest.mark.timeout(600)

# Measured with the defaults (seed 0, `make run`, runs repeat exactly): eval reward 0.06
# untrained, 0.31 at step 50, 0.52 at 100, 0.67 at 150, 0.87 at 300.
STEPS, MARGIN = 150, 0.3


async def test_grpo_beats_the_untrained_policy_and_writes_plots(tmp_path, monkeypatch):
    # the exclusive policy: the generator must sleep for the trainer, whose wake is under way
    # while the completions are scored (the budget policy may keep both awake)
    cfg = load_config(overrides=[f"run.steps={STEPS}", f"run.eval_every={STEPS}",
                                 f"run.out={tmp_path}", "run.policy=exclusive"])
    loop = Loop(cfg)
    generator_awake_while_scoring = []
    score = DigitTask.score

    async def watched_score(self, where, *args):
        if where.startswith("step"):  # the trainer's wake is under way by now (switch_ahead_s)
            view = loop.runtime.rm.view
            generator_awake_while_scoring.append(
                any(view.awake_now(r.tenant) for r in loop.generator.replicas))
        return await score(self, where, *args)

    monkeypatch.setattr(DigitTask, "score", watched_score)
    summary = await loop.run()
    assert generator_awake_while_scoring == [False] * STEPS
    assert summary["final_eval_reward"] >= summary["untrained_eval_reward"] + MARGIN
    assert summary["devices"] == {"trainer": ["cpu"], "generator": ["cpu"]}  # no GPU here
    for name in ("reward.png", "memory.png", "metrics.json"):
        assert (tmp_path / name).stat().st_size > 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    steps = [s for s in metrics["steps"] if s["step"] >= 0]
    assert len(steps) == STEPS
    assert all(s["switch_ahead_s"] > 0 for s in steps)
    held = {r["tenant"] for r in metrics["memory"] if r["bytes"] > 0}
    assert held == {"trainer", "generator"}  # both held memory, in turn
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert len(events.Scalars("rl/reward")) == STEPS
    assert [e.value for e in events.Scalars("rl/eval_reward")][-1] == \
        pytest.approx(summary["final_eval_reward"], rel=1e-6)  # events hold float32
    assert len(events.Scalars("memory_mib/trainer")) == len(metrics["memory"]) // 2


async def test_the_loop_trains_a_given_model_directory_sharded_over_two_slots(tmp_path):
    """`model.path`: a Qwen3 directory with its own tokenizer, trained with FSDP on 2 slots
    beside 2 generator replicas (measured: eval 0.06 -> 0.27 in 30 steps)."""
    path = write_tiny_model(tmp_path / "qwen3", "qwen3", alphabet="0123456789>",
                            max_positions=16, init_std=0.1, seed=3)
    cfg = load_config(overrides=[f"model.path={path}", "trainer.parallel=fsdp",
                                 "run.slots=2", "run.steps=30", "run.eval_every=30",
                                 f"run.out={tmp_path / 'run'}"])
    summary = await Loop(cfg).run()
    assert summary["final_eval_reward"] >= summary["untrained_eval_reward"] + 0.1
    recorded = json.loads((tmp_path / "run" / "metrics.json").read_text())["config"]
    assert recorded["model"]["path"] == str(path)
    assert recorded["trainer"]["parallel"] == "fsdp" and recorded["run"]["slots"] == 2


class KillingHooks(Hooks):
    """SIGKILLs the generator replica's proc as step `kill_at` starts generating; keeps the
    weights every step ended with, and those a respawned replica got, to compare."""

    def __init__(self, kill_at: int) -> None:
        self.kill_at, self.index, self.killed_pid = kill_at, -1, 0
        self.trainer_sums: list[str] = []
        self.resynced_sum = ""

    async def started(self) -> None:
        self.loop.generator.on_respawn.append(self.resynced)  # runs after the loop's resync

    async def step_began(self, index: int) -> None:
        self.index = index

    async def phase(self, label: str) -> None:
        if label == "generate" and self.index == self.kill_at and not self.killed_pid:
            info = await self.loop.generator.replicas[0].actors.describe.call_one()
            self.killed_pid = info.pid
            os.kill(info.pid, signal.SIGKILL)

    async def step_ended(self, index: int, row: dict) -> None:
        if not self.loop.cfg.run.colocate:  # colocated, the trainer sleeps after each sync
            self.trainer_sums.append(await self.loop.trainer.checksum.route())

    async def resynced(self, replica) -> None:
        self.resynced_sum = await replica.actors.checksum.call_one()  # before it serves


def killing_loop(cfg, kill_at: int) -> Loop:
    return Loop(cfg, hooks=KillingHooks(kill_at))


async def test_the_loop_survives_a_killed_generator_replica(tmp_path):
    """Trainer and generator on separate procs (a colocated kill takes the trainer too):
    the step retries on the generator's respawned replica, which gets the trainer's
    weights before it serves, and the run completes."""
    cfg = load_config(overrides=["run.steps=8", "run.eval_every=8", "run.colocate=false",
                                 f"run.out={tmp_path}"])
    loop = killing_loop(cfg, kill_at=3)
    summary = await loop.run()
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert [s["step"] for s in metrics["steps"] if s["step"] >= 0] == list(range(8))
    assert summary["final_eval_reward"] >= 0
    hooks = loop.hooks
    assert hooks.killed_pid and not psutil.pid_exists(hooks.killed_pid)
    replica = loop.generator.replicas[0]
    assert replica.generation == 1 and loop.runtime.resyncs == 1
    # the respawned replica served with trained weights, never the initial ones
    assert hooks.resynced_sum in hooks.trainer_sums[2:]


async def test_without_restarts_a_killed_colocated_proc_ends_the_run_with_the_cause(tmp_path):
    """Colocated, the kill takes the trainer too; with run.max_restarts=0 its weights and
    optimizer state do not come back: the run stops with an error that says so, and keeps
    the steps it finished."""
    cfg = load_config(overrides=["run.steps=8", "run.eval_every=8", "run.max_restarts=0",
                                 f"run.out={tmp_path}"])
    cause = r"(?s)'generator' has no healthy.*'trainer' does not respawn.*spawn the service"
    with pytest.raises(ServiceUnavailableError, match=cause):
        await killing_loop(cfg, kill_at=3).run()
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert "ServiceUnavailableError" in metrics["summary"]["failed"]
    assert [s["step"] for s in metrics["steps"] if s["step"] >= 0] == [0, 1, 2]


def test_config_rejects_bad_overrides():
    with pytest.raises(ValueError, match="section.field=value"):
        load_config(overrides=["steps=3"])
    with pytest.raises(ValueError, match="run.stepz: Key 'stepz' not in 'RunConfig'"):
        load_config(overrides=["run.stepz=3"])
    with pytest.raises(ValueError, match="^run.steps='abc': expected a value of type Integer$"):
        load_config(overrides=["run.steps=abc"])
    with pytest.raises(ValueError, match="trainer.parallel='zero'"):
        load_config(overrides=["trainer.parallel=zero"])
    with pytest.raises(ValueError, match="mixed_precision=true needs trainer.parallel=fsdp"):
        load_config(overrides=["trainer.mixed_precision=true"])


def test_config_converts_values_to_their_fields_types():
    """YAML reads `1e-3` as a string: it must still become the float the field wants."""
    cfg = load_config(overrides=["run.steps=100", "grpo.lr=1e-3", "model.path=/models/qwen",
                                 "trainer.parallel=fsdp", "trainer.mixed_precision=true"])
    assert cfg.run.steps == 100 and cfg.grpo.lr == 1e-3 and isinstance(cfg.grpo.lr, float)
    assert cfg.model.path == "/models/qwen" and cfg.trainer.parallel == "fsdp"
    assert cfg.trainer.mixed_precision is True
    with pytest.raises(ValueError, match="run.engine"):
        load_config(overrides=["run.engine=tensorrt"])


def readme_commands() -> list[list[str]]:
    """The arguments of every `python -m examples.rl_loop ...` command in the README and the
    docs: in backquotes or on a line of a code block (without its comment)."""
    root = Path(__file__).parents[1]
    text = "\n".join(p.read_text() for p in [root / "README.md", *(root / "docs").glob("*.md")])
    found = re.findall(r"python -m examples\.rl_loop([^`\n#]*)", text)
    return [shlex.split(args) for args in found]


def test_every_rl_loop_command_in_the_readme_parses():
    commands = readme_commands()
    assert len(commands) >= 6
    for args in commands:
        engine = args[args.index("--engine") + 1] if "--engine" in args else None
        overrides = [a for a in args if "=" in a] + ([f"run.engine={engine}"] if engine else [])
        load_config(overrides=overrides)  # raises on a field or value it would refuse


async def test_the_same_seed_gives_the_same_run(tmp_path):
    """Sampling is seeded from run.seed and the step (and each request's place in the
    batch), so two runs with one config agree step by step, bit for bit."""
    runs = []
    for name in ("a", "b"):
        cfg = load_config(overrides=["run.seed=7", "run.steps=4", "run.eval_every=4",
                                     f"run.out={tmp_path / name}"])
        await Loop(cfg).run()
        steps = json.loads((tmp_path / name / "metrics.json").read_text())["steps"]
        runs.append([(s["step"], s["reward"], s.get("loss"), s.get("eval_reward"))
                     for s in steps])
    assert runs[0] == runs[1]
    assert len({reward for _, reward, _, _ in runs[0][1:]}) > 1  # the steps differ


def test_run_wandb_logs_steps_memory_and_summary_to_an_offline_run(tmp_path):
    pytest.importorskip("wandb")
    from examples.rl_loop.config import as_dict
    from examples.rl_loop.record import RunRecord

    record = RunRecord(config=as_dict(load_config(overrides=["run.wandb=true"])),
                       wandb_dir=tmp_path)
    record.step({"step": -1, "reward": None, "eval_reward": 0.06})
    for step in range(3):
        record.step({"step": step, "reward": 0.1 * step, "loss": 1.0 - step})
    record.reading("trainer", 2**20)
    record.write(tmp_path, {"final_eval_reward": 0.5})
    [run] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    logged = run.read_bytes()  # protobuf records: the keys are there as written
    for key in (b"rl/loss", b"rl/eval_reward", b"memory_mib/trainer", b"final_eval_reward"):
        assert key in logged


def test_run_wandb_without_wandb_installed_says_how(tmp_path, monkeypatch):
    from examples.rl_loop.record import RunRecord

    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails
    with pytest.raises(RuntimeError, match="pip install wandb"):
        RunRecord(config={}, wandb_dir=tmp_path)


@pytest.mark.parametrize("reference", [False, True], ids=["two_tenants", "with_a_reference"])
def test_the_step_clock_gives_each_figure_its_definition(monkeypatch, reference):
    """`timing.StepClock`'s figures, from the readings of the clock a step takes at the end
    of each of its parts: each phase's own time; switch_s the waits for the generator's,
    the reference's and the trainer's wakes; step_s the wall time to the end of the sync,
    less the readings; readings_s every reading, the last one (after the sync) included."""
    from examples.rl_loop import timing

    t = [0.0, 0.1, 0.3, 1.3, 1.7, 1.9, 2.0, 2.6, 2.8, 2.85, 3.85, 3.95, 4.25, 4.3]
    start, woken, generating, generated, scored, ref_woken, referencing, referenced, \
        trainer_woken, training, trained, kept, synced, end = t
    laps = ["generator_switch", "readings", "generate", "score", "reference_switch", "readings",
            "reference", "switch", "readings", "train", "save", "sync", "readings"]
    if not reference:  # no reference: its three readings of the clock are not taken
        t = t[:5] + t[8:]
        ref_woken = referencing = referenced = scored
        laps = laps[:4] + laps[7:]
    reads = iter(t)
    monkeypatch.setattr(timing.time, "monotonic", lambda: next(reads))
    clock = timing.StepClock()
    for span in laps:
        clock.lap(span)
    readings = (generating - woken) + (referencing - ref_woken) + (training - trainer_woken)
    expected = {
        "generate_s": generated - generating, "score_s": scored - generated,
        "reference_s": referenced - referencing, "reference_switch_s": ref_woken - scored,
        "generator_switch_s": woken - start,
        "train_s": trained - training, "save_s": kept - trained,
        "switch_s": (woken - start) + (ref_woken - scored) + (trainer_woken - referenced),
        "switch_ahead_s": 0.5, "sync_s": synced - kept, "step_s": synced - start - readings,
        "readings_s": readings + (end - synced)}
    got = clock.metrics(switch_ahead_s=0.5)
    assert list(got) == list(expected)  # metrics.json keeps this order
    assert got == pytest.approx(expected, abs=1e-12)
    with pytest.raises(ValueError, match="no span 'generation'"):
        clock.lap("generation")
