"""The guides' scripts run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.timeout(300)
def test_the_own_tenants_guide_runs_as_written(tmp_path):
    text = (ROOT / "docs" / "your_own_tenants.md").read_text()
    script = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    (tmp_path / "own.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "own.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "caught: tenant 'a_r0' is asleep" in done.stdout
    assert "spawned by hand: True" in done.stdout


@pytest.mark.timeout(300)
def test_the_readme_restart_example_runs_as_written(tmp_path):
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Restarting a group"):]
    script = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "restart.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "restart.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step after the restart: 4" in done.stdout
    assert "new processes: True shared again: True" in done.stdout
    assert "restarts: [(1, " in done.stdout
