"""The RL loop's partial mode (issue 37): a token budget per step, unfinished samples carried
over and continued on newer weights, a run that repeats and resumes as the same run (also
after a killed proc), and the sync mode as it was."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
from pathlib import Path

import pytest
import torch

from examples.rl_loop import task
from examples.rl_loop.config import as_dict, load_config
from examples.rl_loop.grpo import GRPOConfig, grpo_loss
from examples.rl_loop.hooks import Hooks
from examples.rl_loop.loop import Loop
from examples.rl_loop.state import LoopState, identity

pytestmark = pytest.mark.timeout(900)

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "rl_loop" / "long_tail.yaml"
# small and quick: a random model writes long completions, so samples carry over
SMALL = ["rollout.mode=partial", "rollout.max_tokens_per_step=6", "grpo.prompts_per_step=6",
         "task.eval_size=16", "run.seed=3", "run.eval_every=3"]
KEYS = ("reward", "loss", "eval_reward", "finished_samples", "carried_samples",
        "carried_tokens", "staleness_hist", "is_weight", "gen_idle_share")


async def run(out: Path, *overrides: str) -> list[dict]:
    cfg = load_config(CONFIG, [*SMALL, f"run.out={out}", *overrides])
    await Loop(cfg).run()
    return json.loads((out / "metrics.json").read_text())["steps"]


def figures(steps: list[dict]) -> list[tuple]:
    return [(s["step"], *(s.get(k) for k in KEYS)) for s in steps]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The 6-step partial run the others compare with (its own event loop: module-wide)."""
    out = tmp_path_factory.mktemp("partial") / "whole"
    return out, asyncio.run(run(out, "run.steps=6", "run.save_every=0"))


async def test_partial_mode_carries_samples_over_and_trains_finished_groups(whole):
    _, steps = whole
    rows = steps[1:]
    assert len(rows) == 6
    assert all(r["finished_samples"] > 0 and r["finished_samples"] % 4 == 0 for r in rows)
    assert any(r["carried_samples"] > 0 and r["carried_tokens"] > 0 for r in rows)
    spans = {int(k) for r in rows for k in r["staleness_hist"]}
    assert max(spans) >= 1  # some trained samples span two versions or more
    assert max(spans) <= 4  # rollout.max_staleness
    assert any("is_weight" in r for r in rows)  # the older tokens' importance weights
    assert all(0 <= r["gen_idle_share"] < 1 and r["samples_per_s"] > 0 for r in rows)


async def test_the_same_seed_gives_the_same_partial_run(whole, tmp_path):
    _, steps = whole
    again = await run(tmp_path / "again", "run.steps=6", "run.save_every=0")
    assert figures(again) == figures(steps)


async def test_a_run_resumed_with_carried_samples_is_the_run_never_stopped(whole, tmp_path):
    _, steps = whole
    out = tmp_path / "stopped"
    await run(out, "run.steps=3", "run.save_every=3")
    saved = LoopState.read(out / "checkpoints" / "step_00000003" / "loop.json")
    assert saved.carried["version"] == 3 and saved.carried["groups"]  # samples under way
    resumed = await run(out, "run.steps=6", "run.save_every=3", "run.resume=auto")
    assert figures(resumed) == figures(steps)
    # a partial checkpoint is not a sync run's: resuming it in sync mode is refused
    with pytest.raises(Exception, match="rollout"):
        await run(out, "run.steps=7", "run.save_every=3", "rollout.mode=sync")


async def test_with_overlap_the_next_round_runs_while_a_step_trains_and_resumes_exactly(
        tmp_path):
    """rollout.overlap: each step's next round is generated beside its training (tokens
    of the weights the step trained on, taken in before its sync), with a token budget, so
    a run stopped and resumed (the next step's prompts in its checkpoint) is the run never
    stopped."""
    overlap = ("rollout.overlap=true", "run.eval_every=2")
    whole = await run(tmp_path / "whole", "run.steps=4", "run.save_every=0", *overlap)
    rows = whole[1:]
    assert all(r["prefetched_tokens"] > 0 for r in rows)
    assert max(int(k) for r in rows for k in r["staleness_hist"]) >= 1
    out = tmp_path / "stopped"
    await run(out, "run.steps=2", "run.save_every=2", *overlap)
    saved = LoopState.read(out / "checkpoints" / "step_00000002" / "loop.json")
    assert {g["started"] for g in saved.carried["groups"]} >= {2}  # step 2's, drawn ahead
    resumed = await run(out, "run.steps=4", "run.save_every=2", "run.resume=auto", *overlap)
    assert figures(resumed) == figures(whole)
    with pytest.raises(ValueError, match="rollout.overlap=true .* needs rollout.mode=partial"):
        load_config(CONFIG, ["rollout.overlap=true"])
    # the slot proc killed as step 3 generates (a round under way, samples carried): the
    # group restarts, the loop goes back to step 2's checkpoint, and the run is the same
    killing = Loop(load_config(CONFIG, [*SMALL, f"run.out={tmp_path / 'killed'}",
                                        "run.steps=4", "run.save_every=2", *overlap]),
                   hooks=KillingHooks())
    await killing.run()
    killed = json.loads((tmp_path / "killed" / "metrics.json").read_text())
    assert killing.hooks.killed and [r["resumed_at"] for r in killed["restarts"]] == [2]
    assert figures(killed["steps"]) == figures(whole)


class KillingHooks(Hooks):
    """SIGKILLs the generator's proc (the trainer's too: they share it) as step 3's first
    generate call goes out."""

    index, killed = -1, 0

    async def step_began(self, index: int) -> None:
        self.index = index

    async def phase(self, label: str) -> None:
        if label == "generate" and self.index == 3 and not self.killed:
            self.killed = self.loop.generator.replicas[0].allocation.pids[0]
            os.kill(self.killed, signal.SIGKILL)


async def test_sync_mode_is_unchanged(tmp_path):
    cfg = load_config(overrides=["run.steps=2", "run.eval_every=2", f"run.out={tmp_path}"])
    assert cfg.rollout.mode == "sync"
    assert "rollout" not in identity(as_dict(cfg))
    await Loop(cfg).run()
    steps = json.loads((tmp_path / "metrics.json").read_text())["steps"]
    assert all(r["finished_samples"] == 128 and "carried_samples" not in r
               and "is_weight" not in r for r in steps[1:])


def test_the_loss_without_older_tokens_is_the_sync_loss_and_truncates_their_weight():
    torch.manual_seed(0)
    cfg = GRPOConfig()
    logprobs = torch.randn(4, 6, requires_grad=True)
    behaviour, mask = torch.randn(4, 6), torch.ones(4, 6)
    advantages = torch.randn(4)
    plain, _ = grpo_loss(logprobs, behaviour, advantages, mask, cfg)
    same, _ = grpo_loss(logprobs, behaviour, advantages, mask, cfg,
                        prox_logprobs=logprobs.detach() + 1, stale=torch.zeros(4, 6))
    assert torch.equal(plain, same)
    stale = torch.zeros(4, 6)
    stale[:, :3] = 1
    prox = behaviour + 5.0  # far more likely now than when sampled: the weight is cut at C
    _, stats = grpo_loss(logprobs, behaviour, advantages, mask, cfg, prox_logprobs=prox,
                         stale=stale, is_cap=2.0)
    assert stats["is_weight"] == pytest.approx(2.0) and stats["is_truncated_frac"] == 1.0


def test_the_long_tail_task_and_the_uniform_one_as_before():
    uniform = task.TaskConfig()
    rng, before = random.Random(5), random.Random(5)
    drawn = [task._prompt(uniform, rng) for _ in range(50)]
    expected = []
    for _ in range(50):  # the draws the task made before length_decay existed
        n = before.randint(2, 4)
        expected.append("".join(before.choice(task.DIGITS) for _ in range(n)) + ">")
    assert drawn == expected
    tail = load_config(CONFIG).task
    lengths = [len(p) - 1 for p in task.sample_prompts(tail, 2000, random.Random(0))]
    assert min(lengths) >= 1 and max(lengths) > 16 and sum(lengths) / len(lengths) < 8
