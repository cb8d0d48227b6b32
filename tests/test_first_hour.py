"""The first hour with the RL loop's command line: a list field given one value, config and
input errors as one line with exit status 2, `--help` listing every field, and a memory
plot that stays readable at any number of steps. Fast: every error here is met before
anything starts, and the plot is drawn from synthetic readings."""

from __future__ import annotations

import random
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from matplotlib.collections import PolyCollection

from examples.rl_loop import __main__ as cli
from examples.rl_loop import record as record_module
from examples.rl_loop.config import list_fields, load_config, sections
from examples.rl_loop.record import DETAILED_STEPS, ENVELOPE_BINS, RunRecord
from examples.rl_loop.state import RunLock

ROOT = Path(__file__).resolve().parents[1]
USER_TASK = ["data.eval_files=b.jsonl", "reward.funcs=mod:fn", "grpo.max_completion_length=3"]


def rl_loop(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "examples.rl_loop", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The refusal's line, after checking it is the only one that says anything went wrong
    and that it came with exit status 2 and no traceback."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    return errors[0]


# ---- a list field given one value ----

def test_a_list_field_given_one_value_is_a_list_of_one():
    cfg = load_config(overrides=["data.train_files=a.jsonl", *USER_TASK,
                                 "reward.weights=0.5"])
    assert cfg.data.train_files == ["a.jsonl"] and cfg.data.eval_files == ["b.jsonl"]
    assert cfg.reward.funcs == ["mod:fn"] and cfg.reward.weights == [0.5]
    # a path with a comma, or a file.py:function, stays one value
    cfg = load_config(overrides=["data.train_files=runs/a,b.jsonl", *USER_TASK[:2],
                                 "reward.funcs=tasks/r.py:correct", USER_TASK[2]])
    assert cfg.data.train_files == ["runs/a,b.jsonl"]
    assert cfg.reward.funcs == ["tasks/r.py:correct"]


def test_a_list_field_still_takes_a_list_and_an_empty_value_clears_it():
    cfg = load_config(overrides=["data.train_files=[a.jsonl,c.jsonl]", *USER_TASK[:1],
                                 "reward.funcs=[m:f,x.py:g]", "reward.weights=[1,0.5]",
                                 USER_TASK[2]])
    assert cfg.data.train_files == ["a.jsonl", "c.jsonl"]
    assert cfg.reward.funcs == ["m:f", "x.py:g"] and cfg.reward.weights == [1.0, 0.5]
    cfg = load_config(overrides=["data.train_files=", "data.eval_files="])
    assert cfg.data.train_files == [] and not cfg.data.used


def test_a_list_field_given_one_value_in_the_config_file(tmp_path):
    file = tmp_path / "task.yaml"
    file.write_text("data:\n  train_files: a.jsonl\n  eval_files: [b.jsonl]\n"
                    "reward:\n  funcs: mod:fn\ngrpo:\n  max_completion_length: 3\n")
    cfg = load_config(file)
    assert cfg.data.train_files == ["a.jsonl"] and cfg.reward.funcs == ["mod:fn"]


def test_the_list_fields_are_found_from_the_dataclasses():
    assert set(list_fields()) >= {("data", "train_files"), ("data", "eval_files"),
                                  ("reward", "funcs"), ("reward", "weights")}


# ---- one line, exit status 2 ----

def test_a_config_error_is_one_line_naming_the_field_with_exit_status_2():
    line = one_error_line(rl_loop("run.stpes=3"))
    assert "run.stpes" in line and "steps" in line  # the field, and what was meant


@pytest.mark.parametrize(("args", "says"), [
    (["run.steps=abc"], "run.steps='abc': expected a value of type Integer"),
    (["grpo.lr=0"], "grpo.lr=0.0: must be > 0"),  # GRPOConfig.lr: named as overridden
    (["steps=3"], "override 'steps=3': write section.field=value"),
    (["run.steps=["], "run.steps=[: not a value the command line can read"),
    (["--config", "nowhere.yaml"], "--config nowhere.yaml: no such file"),
    (["data.train_files=a.jsonl", "reward.funcs=m:f", "grpo.max_completion_length=3"],
     "data.train_files needs data.eval_files"),
])
def test_config_errors_in_process(args, says, capsys):
    with pytest.raises(SystemExit) as stopped:
        cli.main(args)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {says}"), err


def test_a_missing_data_file_is_one_line_with_exit_status_2(tmp_path):
    line = one_error_line(rl_loop(f"data.train_files={tmp_path / 'nope.jsonl'}",
                                  f"data.eval_files={tmp_path / 'nope.jsonl'}",
                                  "reward.funcs=m:f", "grpo.max_completion_length=2",
                                  f"run.out={tmp_path / 'run'}"))
    assert line.startswith("error: data.train_files: ") and "nope.jsonl" in line
    assert "no such file" in line


def test_a_bad_reward_function_is_one_line_with_exit_status_2(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "12", "answer": "12"}\n')
    (tmp_path / "r.py").write_text("def same(completions, **kw):\n    return [1.0]\n")
    line = one_error_line(rl_loop(f"data.train_files={data}", f"data.eval_files={data}",
                                  f"reward.funcs={tmp_path / 'r.py'}:sam",
                                  "grpo.max_completion_length=2",
                                  f"run.out={tmp_path / 'run'}"))
    assert line.startswith("error: reward.funcs: ") and "r.py" in line and "'sam'" in line


def test_a_run_out_in_use_is_one_line_with_exit_status_2(tmp_path):
    """Refused by the run before its runtime starts (a ResumeError): one line too."""
    lock = RunLock(tmp_path / "run")
    try:
        line = one_error_line(rl_loop("run.steps=1", f"run.out={tmp_path / 'run'}"))
    finally:
        lock.release()
    assert "run.out=" in line and "in use by another run" in line


class FailingLoop:
    """A Loop whose run fails as `failure` says: before its runtime started or after."""

    failure: BaseException = RuntimeError("a proc was lost")
    started = True

    def __init__(self, cfg) -> None:
        if self.started:
            self.rm = object()  # the runtime's resource manager: it started

    async def run(self) -> dict:
        raise self.failure


def test_a_failure_during_the_run_keeps_its_traceback(monkeypatch, tmp_path):
    import examples.rl_loop.loop as loop_module

    monkeypatch.setattr(loop_module, "Loop", FailingLoop)
    with pytest.raises(RuntimeError, match="a proc was lost"):
        cli.main([f"run.out={tmp_path}"])
    monkeypatch.setattr(FailingLoop, "failure", ValueError("a tensor of the wrong shape"))
    with pytest.raises(ValueError, match="wrong shape"):  # the runtime had started
        cli.main([f"run.out={tmp_path}"])
    monkeypatch.setattr(FailingLoop, "started", False)
    with pytest.raises(SystemExit) as stopped:  # a ValueError before it started: refused
        cli.main([f"run.out={tmp_path}"])
    assert stopped.value.code == 2


# ---- --help ----

def test_help_lists_every_field_with_its_type_default_and_meaning():
    result = rl_loop("--help", timeout=60)
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split(None, 3) for line in result.stdout.splitlines()
            if line.startswith("  ") and "." in line.split()[0]}
    for section, cls in sections().items():
        for f in fields(cls):
            key = f"{section}.{f.name}"
            assert key in rows, key
    assert rows["run.steps"][1:3] == ["int", "300"]
    assert rows["data.train_files"][1:3] == ["list[str]", "[]"]
    assert rows["model.max_positions"][2] == "16"  # config.yaml's, what a run gets
    assert rows["run.max_restarts"][3].startswith("a lost proc")


def test_every_field_has_one_meaning():
    """From the comments beside it, or (for a module without them) `UNCOMMENTED`: never
    both, and never neither."""
    rows = {key: meaning for key, _, _, meaning in cli.field_rows()}
    assert all(rows.values()), [key for key, meaning in rows.items() if not meaning]
    commented = {f"{section}.{name}" for section, cls in sections().items()
                 for name, text in cli.meanings(cls).items() if text}
    assert set(cli.UNCOMMENTED) <= set(rows) and not set(cli.UNCOMMENTED) & commented


def test_meanings_follow_the_comments_around_a_field():
    from examples.rl_loop.config import ModelConfig, RunConfig
    from examples.rl_loop.grpo import GRPOConfig

    grpo = cli.meanings(GRPOConfig)
    assert grpo["loss_type"].startswith("how the per-token losses")  # the block above it
    assert grpo["beta"].endswith("0 needs no reference")  # not the block below
    assert cli.meanings(RunConfig)["resume"].endswith("or a directory")  # continued below
    model = cli.meanings(ModelConfig)
    assert model["init_std"].endswith("0.87 with 0.1)") and model["seed"] == \
        "the tiny model's random weights"


# ---- memory.png at any number of steps ----

def synthetic(steps: int) -> RunRecord:
    """A run's record of `steps` steps: the generator and the trainer taking turns."""
    record = RunRecord(config={"run": {"slots": 1}})
    rng, t = random.Random(0), 0.0

    def read(trainer: float, generator: float) -> None:
        for tenant, mib in (("trainer", trainer), ("generator", generator)):
            record.memory.append({"t": t, "tenant": tenant, "bytes": int(mib * 2**20)})

    record.phases.append((t, "start"))
    read(3, 2)
    for _ in range(steps):
        for label, gap, trainer, generator in (("generate", 0.1, 2, 6 + rng.random()),
                                               ("train", 0.3, 6 + rng.random(), 1),
                                               ("sync", 0.2, 6, 4)):
            t += gap
            record.phases.append((t, label))
            read(trainer, generator)
    return record


def drawn(steps: int, monkeypatch, tmp_path: Path) -> list:
    """memory.png's panels, drawn from `steps` synthetic steps (the figure kept open)."""
    figures = []
    monkeypatch.setattr(record_module.plt, "close", figures.append)
    synthetic(steps)._plot_memory(tmp_path / "memory.png")
    assert (tmp_path / "memory.png").stat().st_size > 0
    return figures[0].axes


def test_the_memory_overview_of_2000_steps_has_a_bounded_number_of_points(monkeypatch,
                                                                           tmp_path):
    overview, zoom = drawn(2000, monkeypatch, tmp_path)[:2]
    points = [len(line.get_xdata()) for line in overview.get_lines()]
    assert points and max(points) <= ENVELOPE_BINS + 1
    bands = [c for c in overview.collections if isinstance(c, PolyCollection)]
    assert len(bands) == 2  # one per tenant
    assert all(len(path.vertices) <= 4 * (ENVELOPE_BINS + 2)
               for band in bands for path in band.get_paths())
    assert sum(points) + sum(len(p.vertices) for b in bands for p in b.get_paths()) < 5000
    summary = " ".join(text.get_text() for text in overview.texts)
    assert "2000 steps" in summary and "trainer: 2 to 7" in summary
    assert overview.get_xlim() == (0, 2000)
    assert zoom.get_title() == "the last three steps"  # every switch of those, up close
    # the envelope holds what the readings held: the trainer's least and most
    low, high = record_module._envelope(
        synthetic(2000)._series(0.0)["trainer"],
        [t for t, label in synthetic(2000).phases if label == "generate"])
    assert len(high) == ENVELOPE_BINS and min(low) == 2 and 6.9 < max(high) < 7


def test_a_short_run_draws_every_switch(monkeypatch, tmp_path):
    overview = drawn(DETAILED_STEPS, monkeypatch, tmp_path)[0]
    total = next(line for line in overview.get_lines() if line.get_label() == "total")
    assert len(total.get_xdata()) == 1 + 3 * DETAILED_STEPS  # every reading's moment
