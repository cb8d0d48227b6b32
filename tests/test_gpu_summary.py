"""`tests/gpu/summary.py`, the one summary a GPU session writes: every test by name with its
outcome (from a real pytest run's JUnit XML) and each benchmark's table; a run whose
pytest wrote nothing says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SUMMARY = Path(__file__).parent / "gpu" / "summary.py"


def test_the_summary_names_each_test_by_outcome_and_keeps_each_benchmark_table(tmp_path):
    (tmp_path / "test_some.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_broken(): assert False\n"
        "@pytest.mark.skip(reason='no GPU')\n"
        "def test_needs_gpu(): pass\n")
    out = tmp_path / "out"
    out.mkdir()
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    str(tmp_path / "test_some.py"), f"--junitxml={out / 'gpu-tests.xml'}"],
                   cwd=tmp_path, capture_output=True)
    (out / "bench-memory.log").write_text("warming up\n| pause GB/s | 12.5 |\n")
    (out / "rl-loop-metrics.json").write_text(json.dumps({
        "summary": {"switch_share": 0.04, "devices": {"trainer": ["GPU-0"]},
                    "plan": {"switch_time": {"predicted": 0.03, "measured": 0.025,
                                             "error": 0.2, "target": 0.25}}},
        "steps": [{"step": -1, "eval_reward": 0.1},
                  {"step": 0, "switch_s": 0.01, "sync_s": 0.02, "step_s": 0.5},
                  {"step": 1, "switch_s": 0.03, "sync_s": 0.02, "step_s": 0.7}]}))
    text = subprocess.run([sys.executable, str(SUMMARY), str(out)], capture_output=True,
                          text=True, check=True).stdout
    assert "tests: 1 passed, 1 failed, 1 skipped" in text
    sections = {part.split("\n")[0]: part for part in text.split("## ")[1:]}
    assert "test_ok" in sections["passed"] and "test_broken" in sections["failed"]
    assert "test_needs_gpu" in sections["skipped"]
    assert "| pause GB/s | 12.5 |" in sections["bench-memory"]
    rl = sections["RL loop on the GPU"]
    assert "- switch_share: 0.04" in rl and "GPU-0" in rl
    assert "- mean switch_s over 2 steps: 0.0200" in rl  # the eval row (-1) is not a step
    assert "- switch share from the second step on (median of 1): 0.071" in rl
    assert "- plan switch_time: predicted 0.03, measured 0.025, error +0.200" in rl
    bench = subprocess.run([sys.executable, str(SUMMARY), str(out), "bench"],
                           capture_output=True, text=True, check=True).stdout
    assert "| pause GB/s | 12.5 |" in bench  # benchmarks only: no tests, no RL loop
    assert "tests:" not in bench and "RL loop" not in bench


def test_a_run_without_test_results_says_so(tmp_path):
    text = subprocess.run([sys.executable, str(SUMMARY), str(tmp_path)], capture_output=True,
                          text=True, check=True).stdout
    assert "no gpu-tests.xml (pytest did not get to write it)" in text
    assert "no rl-loop-metrics.json (the run did not get to write it)" in text
