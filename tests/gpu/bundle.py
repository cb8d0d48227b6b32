"""Monarch, packed to travel to the GPU machine within the device tool's 64 MiB carry limit.

Monarch's wheel is 93 MB; its `_rust_bindings` library alone is 281 MB unpacked. Stripped
of its symbol tables (`strip --strip-all` keeps the dynamic symbols a Python extension
needs) it is about 194 MB, and xz packs the stripped package, without its web dashboard,
into about 37 MB. The package still imports, spawns procs and answers endpoints.

    python tests/gpu/bundle.py build WHEEL_OR_SITE_PACKAGES OUT.tar.xz
    python tests/gpu/bundle.py unpack BUNDLE.tar.xz DEST      # DEST then goes on PYTHONPATH

`build` takes a torchmonarch wheel (`device.sh fetch` downloads the cp312 one) or a
site-packages directory where torchmonarch is installed (the tests use this machine's).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGES = ("monarch", "monarch_supervisor")  # what `import monarch.actor` and a proc need
LEFT_OUT = ("monarch/monarch_dashboard",)  # the web dashboard: only monarch.job loads it


def _is_kept(name: str) -> bool:
    top = name.split("/")[0]
    kept = top in PACKAGES or (top.startswith("torchmonarch-") and top.endswith(".dist-info"))
    return kept and not any(name == p or name.startswith(p + "/") for p in LEFT_OUT) \
        and "/__pycache__/" not in name


def stage(source: Path, staging: Path) -> None:
    """Monarch's files from `source` (a wheel, or a site-packages directory) into
    `staging`, without what the procs never load."""
    if source.is_file():
        with zipfile.ZipFile(source) as wheel:
            wheel.extractall(staging, [n for n in wheel.namelist() if _is_kept(n)])
        return
    for path in source.rglob("*"):
        name = path.relative_to(source).as_posix()
        if path.is_file() and _is_kept(name):
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, staging / name)
    if not (staging / "monarch").is_dir():
        raise FileNotFoundError(f"no monarch package under {source}: give a torchmonarch "
                                "wheel or the site-packages it is installed in")


def build(source: Path, out: Path) -> int:
    """The bundle at `out` (a .tar.xz); returns its size in bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        staging = Path(tmp)
        stage(source, staging)
        libraries = [str(p) for p in staging.rglob("*.so")]
        subprocess.run(["strip", "--strip-all", *libraries], check=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "XZ_OPT": "-6 -T0"}
        subprocess.run(["tar", "-cJf", str(out.resolve()), "-C", str(staging),
                        *sorted(p.name for p in staging.iterdir())], check=True, env=env)
    return out.stat().st_size


def unpack(bundle: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-xJf", str(bundle), "-C", str(dest)], check=True)


if __name__ == "__main__":
    verb, first, second = sys.argv[1:4]
    if verb == "build":
        size = build(Path(first), Path(second))
        print(f"{second}: {size / 2**20:.1f} MiB")
    elif verb == "unpack":
        unpack(Path(first), Path(second))
    else:
        sys.exit(f"usage: {sys.argv[0]} build SOURCE OUT.tar.xz | unpack BUNDLE DEST")
