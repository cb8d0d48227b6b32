"""The pytest plugin `colocate.testing` works in a user's own folder, outside this repo
and its pytest settings (this repo sets `asyncio_mode = "auto"`; a user's need not)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)


def test_the_plugin_runs_async_tests_in_a_users_own_folder(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "test_user.py").write_text(textwrap.dedent("""
        pytest_plugins = ["colocate.testing"]

        async def test_runtime_from_a_users_folder(colocate_runtime):
            assert await colocate_runtime.status() is not None

        def test_a_plain_test_is_left_alone(slot_device):
            assert slot_device in ("cpu", "cuda")
    """))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "test_user.py"], cwd=user, env=env, capture_output=True, text=True,
                          timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout
