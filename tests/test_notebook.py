"""examples/rl_loop/notebook.ipynb runs top to bottom in a Jupyter kernel, and shows what it
says it shows.

Executed with nbclient in a kernel of this test's Python (a kernelspec written to a temporary
JUPYTER_PATH, so no other installed "python3" kernel is picked up). Any cell that raises
fails the test (nbclient's CellExecutionError). The last cell prints one JSON line, which is
checked: after `phase(generator)` only the generator holds memory, after the blocking
`with phase(trainer)` only the trainer does, the completions came back, and every RL step
reported a reward in [0, 1].
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from nbclient import NotebookClient

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "rl_loop" / "notebook.ipynb"
KERNEL = "colocate-test"
MARKER = "NOTEBOOK_RESULT "


def run_notebook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Execute the notebook from the repository root; the result line its last cell prints."""
    write_kernel_spec(tmp_path / "jupyter" / "kernels" / KERNEL)  # argv: sys.executable
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name=KERNEL,
                   resources={"metadata": {"path": str(ROOT)}}).execute()
    lines = [line for output in nb.cells[-1].get("outputs", [])
             for line in output.get("text", "").splitlines() if line.startswith(MARKER)]
    assert len(lines) == 1, f"the last cell printed no {MARKER!r} line: {nb.cells[-1].outputs}"
    return json.loads(lines[0].removeprefix(MARKER))


def test_notebook_runs_and_memory_moves_between_tenants(tmp_path, monkeypatch):
    result = run_notebook(tmp_path, monkeypatch)
    assert result["prefix"] == sys.prefix  # the kernel ran in this environment
    readings = {row["after"]: row for row in result["readings"]}
    generator_awake = readings["phase(generator)"]
    assert generator_awake["generator"] > 0 and generator_awake["trainer"] == 0
    trainer_awake = readings["with phase(trainer)"]
    assert trainer_awake["trainer"] > 0 and trainer_awake["generator"] == 0
    assert result["completions"] > 0
    rewards = result["rewards"]
    assert rewards and all(0.0 <= r <= 1.0 for r in rewards)
