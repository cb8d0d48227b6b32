"""The guides' scripts run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def run_first_python_block(text: str, script: Path) -> subprocess.CompletedProcess:
    """The first ```python block of `text`, run as `script` (in its folder, the repo on
    PYTHONPATH, as a user would); it must exit 0."""
    script.write_text(re.search(r"```python\n(.*?)```", text, re.S).group(1))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, script.name], cwd=script.parent, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


@pytest.mark.timeout(300)
def test_the_own_tenants_guide_runs_as_written(tmp_path):
    text = (ROOT / "docs" / "your_own_tenants.md").read_text()
    done = run_first_python_block(text, tmp_path / "own.py")
    assert "caught: tenant 'a_r0' is asleep" in done.stdout
    assert "spawned by hand: True" in done.stdout


@pytest.mark.timeout(300)
def test_the_restart_example_runs_as_written(tmp_path):
    text = (ROOT / "docs" / "runtime.md").read_text()
    done = run_first_python_block(text[text.index("## Restarting a group"):],
                                  tmp_path / "restart.py")
    assert "step after the restart: 4" in done.stdout
    assert "new processes: True shared again: True" in done.stdout
    assert "restarts: [(1, " in done.stdout


@pytest.mark.timeout(300)
def test_the_readme_runtime_example_runs_as_written(tmp_path):
    text = (ROOT / "README.md").read_text()
    done = run_first_python_block(text[text.index("## The runtime, for your own loop"):],
                                  tmp_path / "runtime.py")
    assert "replicas answered: 2" in done.stdout
    assert "'generator_r0': ['weights']" in done.stdout and "'trainer_r0': []" in done.stdout
