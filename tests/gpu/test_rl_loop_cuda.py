"""The RL loop example on one GPU, started as a user starts it (`python -m examples.rl_loop`),
with the torch generator beside the trainer: it trains, saves, exports its model, and a
second command resumes it from its last checkpoint. The CPU twin is
tests/test_durable_runs.py.

Needs Monarch, OmegaConf and TensorBoard beside torch (`device.sh fetch` packs the first
two)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("monarch")
pytest.importorskip("omegaconf")

ROOT = Path(__file__).resolve().parents[2]


def run_loop(out: Path, steps: int) -> dict:
    """One `python -m examples.rl_loop` run into `out`; its metrics.json."""
    command = [sys.executable, "-m", "examples.rl_loop", f"run.steps={steps}",
               "run.save_every=2", "run.eval_every=2", f"run.out={out}"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=150,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "metrics.json").read_text())


@pytest.mark.timeout(600)
def test_the_rl_loop_trains_saves_and_resumes_on_one_gpu(tmp_path, gpus):
    first = run_loop(tmp_path, 4)
    summary = first["summary"]
    # both services ran on the GPU (one slot: the first GPU), not on CPU procs
    gpu = gpus[0].removeprefix("GPU-")
    assert summary["devices"] == {"trainer": [gpu], "generator": [gpu]}, summary
    assert [s["step"] for s in first["steps"]] == [-1, 0, 1, 2, 3]  # -1: the untrained eval
    assert (tmp_path / "model" / "model.safetensors").exists()
    assert 0 < summary["switch_share"] < 1, summary
    resumed = run_loop(tmp_path, 6)
    assert resumed["summary"]["resumed_at"] == 4, resumed["summary"]
    assert [s["step"] for s in resumed["steps"]][-2:] == [4, 5], resumed["steps"]
