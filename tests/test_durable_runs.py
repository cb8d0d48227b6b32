"""Durable RL runs: checkpoints of the loop, exact resume, the trained model out, and the
faults around them (a half-written checkpoint, changed settings, a second run)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from test_rl_loop import killing_loop  # SIGKILLs the generator's proc as a step starts

from examples.rl_loop import task
from examples.rl_loop.config import as_dict, load_config
from examples.rl_loop.hooks import Hooks
from examples.rl_loop.loop import Loop
from examples.rl_loop.state import (
    Checkpoints,
    LoopState,
    PromptSampler,
    ResumeError,
    RunLock,
    find_resume,
    identity,
)

pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parents[1]
COMPARED = ("reward", "loss", "grad_norm", "kl", "eval_reward")


def rows(out: Path) -> dict[int, dict]:
    steps = json.loads((out / "metrics.json").read_text())["steps"]
    return {s["step"]: s for s in steps}


def compared(out: Path) -> list[tuple]:
    return [(step, *(row.get(k) for k in COMPARED)) for step, row in sorted(rows(out).items())]


def fake_checkpoint(checkpoints: Checkpoints, step: int, config: dict, *,
                    trainer: bool = True, loop: bool = True) -> Path:
    """A step directory with the parts a complete checkpoint has (or not): the trainer's
    marker files and a loop state."""
    path = checkpoints.path(step)
    (path / "trainer").mkdir(parents=True)
    if trainer:
        (path / "trainer" / ".metadata").write_bytes(b"x")
        (path / "trainer" / "trainer.json").write_text("{}")
    if loop:
        LoopState(step=step, sampler=PromptSampler(0).state_dict(),
                  identity=identity(config)).write(path / "loop.json")
    return path


def test_the_sampler_goes_on_from_its_saved_position():
    a = PromptSampler(3)
    cfg = task.TaskConfig()
    task.sample_prompts(cfg, 5, a.rng)
    saved = json.loads(json.dumps(a.state_dict()))  # as loop.json keeps it
    b = PromptSampler(99)
    b.load_state_dict(saved)
    assert task.sample_prompts(cfg, 7, a.rng) == task.sample_prompts(cfg, 7, b.rng)


def test_resume_picks_the_newest_complete_checkpoint_and_never_a_half_written_one(tmp_path):
    config = as_dict(load_config())
    checkpoints = Checkpoints(tmp_path, keep_last=2)
    fake_checkpoint(checkpoints, 10, config)
    fake_checkpoint(checkpoints, 20, config)
    fake_checkpoint(checkpoints, 30, config, loop=False)  # killed before the loop's part
    fake_checkpoint(checkpoints, 40, config, trainer=False)  # the trainer's never renamed
    path, state = find_resume("auto", checkpoints, config)
    assert path == checkpoints.path(20) and state.step == 20
    assert find_resume("none", checkpoints, config) is None
    # a run directory given as run.resume: the newest complete checkpoint under it
    assert find_resume(str(tmp_path), checkpoints, config)[0] == checkpoints.path(20)
    with pytest.raises(ResumeError, match="not a complete checkpoint.*give an earlier one"):
        find_resume(str(checkpoints.path(30)), Checkpoints(tmp_path / "x", 1), config)
    with pytest.raises(ResumeError, match="no such directory"):
        find_resume(str(tmp_path / "nowhere"), checkpoints, config)
    assert find_resume("auto", Checkpoints(tmp_path / "empty", 1), config) is None


def test_prune_keeps_the_newest_complete_ones_and_a_save_in_flight(tmp_path):
    config = as_dict(load_config())
    checkpoints = Checkpoints(tmp_path, keep_last=2)
    for step in (10, 20, 30):
        fake_checkpoint(checkpoints, step, config)
    fake_checkpoint(checkpoints, 15, config, loop=False)  # older, half-written
    fake_checkpoint(checkpoints, 40, config, loop=False)  # the save in flight
    checkpoints.prune()
    assert sorted(p.name for p in tmp_path.iterdir()) == \
        ["step_00000020", "step_00000030", "step_00000040"]


def test_a_resume_with_other_settings_is_refused_naming_them(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep_last=2)
    fake_checkpoint(checkpoints, 10, as_dict(load_config()))
    changed = as_dict(load_config(overrides=["grpo.lr=0.01", "run.seed=3", "run.steps=900",
                                             "run.eval_every=7"]))
    with pytest.raises(ResumeError) as err:
        find_resume("auto", checkpoints, changed)
    message = str(err.value)
    assert "grpo.lr (0.001 -> 0.01)" in message and "run.seed (0 -> 3)" in message
    named = message.split(": ", 1)[1].split(". ")[0]  # the fields that differ
    assert "run.steps" not in named and "eval_every" not in named
    assert "run.resume=none" in message


def test_a_checkpoint_without_a_later_field_resumes_at_its_default_only(tmp_path):
    """A field the saving loop did not have (added since, with a default) is that default
    in its checkpoint: the run resumes as the same run, unless it sets the field."""
    defaults = as_dict(load_config())
    older = dict(defaults, grpo={k: v for k, v in defaults["grpo"].items()
                                 if k != "dynamic_sampling"})
    checkpoints = Checkpoints(tmp_path, keep_last=2)
    path = fake_checkpoint(checkpoints, 10, older)
    assert find_resume("auto", checkpoints, defaults, defaults)[0] == path
    with pytest.raises(ResumeError, match=r"grpo.dynamic_sampling \(False -> True\)"):
        find_resume("auto", checkpoints,
                    as_dict(load_config(overrides=["grpo.dynamic_sampling=true"])), defaults)
    with pytest.raises(ResumeError, match="grpo.dynamic_sampling"):  # no defaults: differs
        find_resume("auto", checkpoints, defaults)


def test_a_corrupt_loop_state_says_what_to_do(tmp_path):
    config = as_dict(load_config())
    checkpoints = Checkpoints(tmp_path, keep_last=2)
    path = fake_checkpoint(checkpoints, 10, config)
    (path / "loop.json").write_text('{"step": 10, "sampl')  # cut short
    with pytest.raises(ResumeError, match="not a loop state.*run.resume=none"):
        find_resume("auto", checkpoints, config)


def test_a_second_run_into_the_same_out_is_refused(tmp_path):
    lock = RunLock(tmp_path)
    with pytest.raises(ResumeError, match=f"in use by another run \\(pid {os.getpid()}\\)"):
        RunLock(tmp_path)
    lock.release()
    RunLock(tmp_path).release()  # free again once the first ended
    # a second process meets the same refusal
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; "
        "from examples.rl_loop.state import RunLock; "
        f"RunLock(Path({str(tmp_path)!r})); print('held', flush=True); time.sleep(60)")],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ResumeError, match=f"pid {holder.pid}"):
            RunLock(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    RunLock(tmp_path).release()  # a killed holder's lock went with it


def test_bad_run_settings_are_refused():
    with pytest.raises(ValueError, match="run.save_every=-1: must be >= 0"):
        load_config(overrides=["run.save_every=-1"])
    with pytest.raises(ValueError, match="run.keep_last=0: must be >= 1"):
        load_config(overrides=["run.keep_last=0"])


async def run_loop(out: Path, *overrides: str) -> dict:
    cfg = load_config(overrides=["run.seed=7", "run.eval_every=1", "run.save_every=2",
                                 f"run.out={out}", *overrides])
    return await Loop(cfg).run()


async def test_a_resumed_run_is_the_same_run(tmp_path):
    """3 steps, then a resume to 5 (from the checkpoint at step 3, the last of the first
    run), give the per-step reward, loss, grad norm and eval of one 5-step run, on 2 slots
    (the trainer a 2-proc FSDP replica, each rank saving its shard; DDP's and one proc's
    checkpoints, and resharding between them, are tests/test_checkpoint.py's); the model
    comes out at the end."""
    shape = ["run.slots=2", "trainer.parallel=fsdp"]
    await run_loop(tmp_path / "full", "run.steps=5", *shape)
    await run_loop(tmp_path / "part", "run.steps=3", *shape)
    summary = await run_loop(tmp_path / "part", "run.steps=5", "run.resume=auto", *shape)
    assert summary["resumed_at"] == 3
    assert compared(tmp_path / "part") == compared(tmp_path / "full")
    assert sorted(rows(tmp_path / "part")) == [-1, 0, 1, 2, 3, 4]
    kept = sorted(p.name for p in (tmp_path / "part" / "checkpoints").iterdir())
    assert kept == ["step_00000004", "step_00000005"]  # every 2 and the last; keep_last=2
    # the command makes the same directory from the run's last checkpoint
    from safetensors.torch import load_file

    from colocate.engines.export import export_checkpoint

    exported = export_checkpoint(tmp_path / "part" / "checkpoints" / "step_00000005",
                                 tmp_path / "exported")
    ours, theirs = (load_file(d / "model.safetensors")
                    for d in (exported, tmp_path / "part" / "model"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    # the model out: a Hugging Face directory whose greedy eval is the run's final eval
    # (transformers' generate, one prompt at a time, against the generator's padded
    # batches: a near tie between two tokens may break the other way)
    prompts = len(task.eval_prompts(task.TaskConfig()))
    assert greedy_eval(tmp_path / "full" / "model") == \
        pytest.approx(summary["final_eval_reward"], abs=2 / prompts)


def greedy_eval(model_dir: Path) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    net = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    cfg = task.TaskConfig()
    prompts = task.eval_prompts(cfg)
    score = 0.0
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            out = net.generate(ids, do_sample=False, max_new_tokens=cfg.max_new_tokens,
                               eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id)
            score += task.reward(prompt, tokenizer.decode(out[0, ids.shape[1]:],
                                                          skip_special_tokens=True))
    return score / len(prompts)


async def pids(service) -> set[int]:
    infos = await service.replicas[0].actors.describe.call()
    return {info.pid for _, info in infos.items()}


@pytest.mark.parametrize("beta", ["0", "0.1"], ids=["two_tenants", "with_a_reference"])
async def test_a_killed_slot_proc_restarts_the_group_and_the_run_ends_as_if_never_killed(
        tmp_path, beta):
    """SIGKILL of the proc a trainer and a generator (and, with grpo.beta > 0, the
    reference) share, in step 3: the group comes back (all in one new process again), the
    loop reloads the checkpoint of step 2 and redoes step 2, and the run ends with the
    per-step metrics of a run never killed, the restart recorded in metrics.json and
    TensorBoard."""
    await run_loop(tmp_path / "full", "run.steps=5", f"grpo.beta={beta}")
    cfg = load_config(overrides=["run.seed=7", "run.eval_every=1", "run.save_every=2",
                                 "run.steps=5", f"grpo.beta={beta}",
                                 f"run.out={tmp_path / 'killed'}"])
    loop = killing_loop(cfg, kill_at=3)
    after: dict[str, set[int]] = {}

    async def shared_pids(event) -> None:
        services = loop.runtime.services()
        after.update({name: await pids(service) for name, service in services.items()})

    started = loop.hooks.started

    async def start() -> None:
        await started()
        loop.recovery.restarts.on_restart.append(shared_pids)

    loop.hooks.started = start
    summary = await loop.run()
    killed = loop.hooks.killed_pid
    assert killed and not psutil.pid_exists(killed)
    assert compared(tmp_path / "killed") == compared(tmp_path / "full")
    assert summary["restarts"] == 1
    [restart] = json.loads((tmp_path / "killed" / "metrics.json").read_text())["restarts"]
    assert (restart["step"], restart["resumed_at"], restart["steps_redone"]) == (3, 2, 1)
    assert str(killed) in restart["cause"] or "died" in restart["cause"]
    assert restart["seconds_lost"] > 0
    assert after["trainer"] == after["generator"] and killed not in after["trainer"]
    assert after.get("reference", after["trainer"]) == after["trainer"]
    assert set(after) == ({"trainer", "generator", "reference"} if float(beta) else
                          {"trainer", "generator"})
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "killed" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("run/restarts")] == [3]
    assert [e.step for e in events.Scalars("rl/reward")] == [0, 1, 2, 3, 4]  # 2 redone once


class WriteFailingHooks(Hooks):
    """Its trainer proc's file size limited to 64 KiB during the first saves after steps 2
    and 4 (the last): their background writes fail (EFBIG, as a full disk would)."""

    failing = {2, 4}

    async def save(self, done: int, save) -> dict:
        if done not in self.failing:
            return await save()
        self.failing = self.failing - {done}
        trainer = self.loop.trainer
        proc = psutil.Process(trainer.replicas[0].allocation.pids[0])
        limit = proc.rlimit(psutil.RLIMIT_FSIZE)
        proc.rlimit(psutil.RLIMIT_FSIZE, (64 << 10, limit[1]))
        try:
            notes = await save()
            while await trainer.poll_checkpoint.route() == "writing":
                await asyncio.sleep(0.01)  # the write ends (fails) under the limit
        finally:
            proc.rlimit(psutil.RLIMIT_FSIZE, limit)
        return notes


async def test_a_failed_checkpoint_write_is_saved_again_at_the_next_step(tmp_path):
    """The write of step 2's checkpoint fails in the background: the step after finds it
    and saves step 3 at once (not at the next save, step 4), notes it in its row, and the
    run goes on, so a later fault would redo at most run.save_every steps; the last save's
    write fails too: the run's end saves it again."""
    cfg = load_config(overrides=["run.seed=7", "run.eval_every=4", "run.save_every=2",
                                 "run.steps=4", "run.keep_last=4", f"run.out={tmp_path}"])
    await Loop(cfg, hooks=WriteFailingHooks()).run()
    rewritten = rows(tmp_path)[2]["checkpoint_rewritten"]
    assert (rewritten["step"], rewritten["found_at"]) == (2, 3), rewritten
    assert "saving checkpoint" in rewritten["cause"] and "too large" in rewritten["cause"]
    complete = [p.name for p in Checkpoints(tmp_path / "checkpoints", 4).complete()]
    assert complete == ["step_00000003", "step_00000004"]  # step 2's never was
    summary = json.loads((tmp_path / "metrics.json").read_text())["summary"]
    assert [(f["step"], f["found_at"]) for f in summary["checkpoint_write_failures"]] == \
        [(2, 3), (4, 4)]
    assert LoopState.read(tmp_path / "checkpoints" / "step_00000004" / "loop.json").step == 4
