"""Monarch packed for the GPU machine (`tests/gpu/bundle.py`, used by `device.sh fetch`):
built from this machine's torchmonarch, it stays well inside the 64 MiB carry limit, leaves
out the dashboard, and, unpacked onto the path, still spawns a proc that answers an endpoint
from the stripped package."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "gpu"))
import bundle  # noqa: E402

CARRY_LIMIT = 64 << 20
PROBE = '''
import asyncio, monarch
from monarch.actor import Actor, endpoint, this_host

class Where(Actor):
    @endpoint
    def monarch_file(self) -> str:
        import monarch
        return monarch.__file__

async def main():
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    where = procs.spawn("where", Where)
    print("client:", monarch.__file__)
    print("proc:", await where.monarch_file.call_one())
    await procs.stop()

if __name__ == "__main__":
    asyncio.run(main())
'''


def test_a_wheel_is_staged_without_the_dashboard_and_bytecode(tmp_path):
    wheel = tmp_path / "torchmonarch-0.7.0-cp312-cp312-manylinux2014_x86_64.whl"
    names = ["monarch/__init__.py", "monarch/actor/__init__.py",
             "monarch/monarch_dashboard/server.py", "monarch/__pycache__/x.pyc",
             "monarch_supervisor/host.py", "torchmonarch-0.7.0.dist-info/METADATA",
             "monarch_other/x.py"]
    with zipfile.ZipFile(wheel, "w") as zf:
        for name in names:
            zf.writestr(name, "x")
    staged = tmp_path / "staged"
    bundle.stage(wheel, staged)
    found = sorted(p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file())
    assert found == ["monarch/__init__.py", "monarch/actor/__init__.py",
                     "monarch_supervisor/host.py", "torchmonarch-0.7.0.dist-info/METADATA"]


def test_a_directory_without_monarch_is_refused_naming_what_to_give(tmp_path):
    with pytest.raises(FileNotFoundError, match="give a torchmonarch wheel"):
        bundle.stage(tmp_path, tmp_path / "staged")


@pytest.mark.timeout(600)
def test_the_bundle_fits_the_carry_limit_and_still_spawns_procs(tmp_path):
    site = Path(importlib.util.find_spec("monarch").origin).parents[1]
    out = tmp_path / "monarch.tar.xz"
    size = bundle.build(site, out)
    # measured: 35.5 MiB (cp311; cp312: 35.6), with 26 MiB of other wheels and the tree
    assert size < 40 << 20 < CARRY_LIMIT, f"{size / 2**20:.1f} MiB"
    with tarfile.open(out) as tar:
        names = tar.getnames()
    assert not [n for n in names if "monarch_dashboard" in n]
    unpacked = tmp_path / "site"
    bundle.unpack(out, unpacked)
    library = next((unpacked / "monarch").glob("_rust_bindings*.so"))
    assert library.stat().st_size < 0.8 * next(site.joinpath("monarch")
                                                .glob("_rust_bindings*.so")).stat().st_size
    (tmp_path / "probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": str(unpacked)}
    done = subprocess.run([sys.executable, "probe.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    assert lines["client"].startswith(str(unpacked))
    assert lines["proc"].startswith(str(unpacked))  # the proc runs the stripped package too
