"""The guides' scripts run as written, and the prose says what is, not when or after which issue."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]

# History in the prose: the project's own issue numbers ("issue 24"; an upstream project's
# "vllm-project/vllm#48620" or "issue #111" is a citation and stays), dates, and the
# "this module's one job is" opening instead of what the module is and why.
NARRATION = re.compile(r"\bissue \d+\b|\b20\d\d-\d\d-\d\d\b|this module's one job", re.I)
DOCSTRING_PACKAGES = ("colocate", "services", "examples/rl_loop", "bench")


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


def docstrings(path: Path) -> list[tuple[int, str]]:
    """The docstrings of `path`'s module, classes and functions, each with its line."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node)
            if text:
                found.append((node.body[0].lineno, text))
    return found


def narration_hits() -> list[str]:
    """Every NARRATION match in README.md, docs/*.md and the docstrings of
    DOCSTRING_PACKAGES, as `path:line: match`."""
    hits = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            hits += [f"{path.relative_to(ROOT)}:{lineno}: {m.group(0)!r}"
                     for m in NARRATION.finditer(line)]
    for package in DOCSTRING_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for lineno, text in docstrings(path):
                hits += [f"{path.relative_to(ROOT)}:{lineno}: {m.group(0)!r}"
                         for m in NARRATION.finditer(text)]
    return hits


def test_the_prose_narrates_no_history():
    """README.md, docs/ and the docstrings say what the code is and why, in the present
    tense: no issue numbers of this project, no dates, no "this module's one job is"."""
    hits = narration_hits()
    assert not hits, "history or boilerplate in the prose:\n" + "\n".join(hits)


def test_the_narration_scan_sees_what_it_looks_for(tmp_path):
    """The pattern finds each kind of hit, in any case, and leaves upstream citations."""
    for text in ("see Issue 24", "on 2026-11-26", "This module's one job is to"):
        assert NARRATION.search(text), text
    for text in ("vllm-project/vllm#48620", "torch_memory_saver issue #111", "tissue 3"):
        assert not NARRATION.search(text), text
    module = tmp_path / "m.py"
    module.write_text('"""Mod, issue 7."""\nclass C:\n    """On 2026-01-02."""\n'
                      'def f():\n    """this module\'s one job"""\n')
    assert [line for line, _ in docstrings(module)] == [1, 3, 5]
