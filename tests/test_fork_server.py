"""Procs forked from the fork server (`colocate.resources.zygote`) are the procs their
command would have started: the same module, environment, directory and threads, in a
process that already has torch; the command stands in for the fork (exit code, signals,
its death and the server's), and without a server the command starts the proc itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from colocate.resources import zygote
from colocate.resources.packing import ResourceRequest
from colocate.resources.proc_main import FORK_ENV
from colocate.resources.zygote import FORK_PROCS_ENV
from colocate.testing import start_runtime

pytestmark = pytest.mark.timeout(120)

PROBE = '''
import json, os, signal, sys, time
from colocate.resources.proc_main import FORK_ENV
preloaded = "torch" in sys.modules
extra = [m for m in os.environ.get("PROBE_PRELOADED", "").split(",") if m in sys.modules]
import torch
if os.environ.get("PROBE_SLEEPS"):
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(15))  # a proc's graceful stop
print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "preloaded": preloaded,
                  "threads": torch.get_num_threads(), "cwd": os.getcwd(),
                  "said": os.environ.get("PROBE_SAYS"), "fork": os.environ.get(FORK_ENV),
                  "argv": sys.argv, "extra": extra,
                  "set_by_import": os.environ.get("PROBE_SET_BY_IMPORT")}), flush=True)
if os.environ.get("PROBE_SLEEPS"):
    time.sleep(60)
sys.exit(3)
'''


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    (tmp_path / "probe_main.py").write_text(PROBE)
    return tmp_path


def command(probe: Path, server: str | None, **env: str) -> subprocess.Popen:
    """A proc's command, as `procs.bootstrap_command` writes it, running `probe_main`."""
    full = {**os.environ, "PYTHONPATH": f"{probe}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            **env}
    full.pop(FORK_ENV, None)
    if server:
        full[FORK_ENV] = server
    return subprocess.Popen(
        [sys.executable, "-c", "from colocate.resources.proc_main import run; "
         "run('probe_main')"], cwd=probe, env=full, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)


def said(proc: subprocess.Popen) -> dict:
    return json.loads(proc.stdout.readline())


def gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_a_forked_proc_is_what_its_command_would_have_run(probe):
    server = zygote.address()
    forked, started = (command(probe, server, PROBE_SAYS="hi", OMP_NUM_THREADS="1"),
                       command(probe, None, PROBE_SAYS="hi", OMP_NUM_THREADS="1"))
    a, b = said(forked), said(started)
    assert (forked.wait(30), started.wait(30)) == (3, 3)  # its exit code, through its command
    assert a["ppid"] == zygote.server_pid() and a["pid"] != forked.pid and a["preloaded"]
    assert b["pid"] == started.pid and not b["preloaded"]
    for key in ("threads", "cwd", "said", "argv", "fork"):  # the server's own are not its
        assert a[key] == b[key], key
    assert (a["threads"], a["fork"], a["cwd"]) == (1, None, str(probe))


def test_the_command_and_its_fork_end_together(probe):
    server = zygote.address()
    for victim, sig, code in (("fork", signal.SIGKILL, -signal.SIGKILL),
                              ("command", signal.SIGTERM, 15),  # forwarded: the fork's exit
                              ("command", signal.SIGKILL, -signal.SIGKILL)):
        proc = command(probe, server, PROBE_SLEEPS="1")
        fork = said(proc)["pid"]
        os.kill(fork if victim == "fork" else proc.pid, sig)
        assert proc.wait(30) == code, (victim, sig)
        assert gone(fork), f"the fork lives on after its {victim} got {sig!r}"


@pytest.mark.parametrize("ending", ["its starter ends", "SIGTERM"])
def test_the_forks_of_a_server_that_ends_are_killed(probe, tmp_path, ending):
    path = str(tmp_path / "server" / "socket")
    os.mkdir(os.path.dirname(path))
    server = subprocess.Popen([sys.executable, "-m", "colocate.resources.zygote", path],
                              stdin=subprocess.PIPE)
    while not Path(path).exists():  # bound as it starts
        time.sleep(0.01)
    proc = command(probe, path, PROBE_SLEEPS="1")
    fork = said(proc)["pid"]
    assert fork != proc.pid
    if ending == "SIGTERM":  # as a job's end (scancel, torchx's kill) signals its processes
        server.send_signal(signal.SIGTERM)
    else:
        server.stdin.close()  # as when the process that started it ends
    assert proc.wait(30) == 1 and "fork server" in proc.stderr.read()
    assert gone(fork) and server.wait(30) == 0
    assert not Path(path).parent.exists()  # its socket and the socket's folder


def test_what_a_server_is_told_to_preload_later_forks_have_imported(probe, tmp_path):
    (probe / "sets_env.py").write_text(
        "import os\nos.environ['PROBE_SET_BY_IMPORT'] = 'imported'\n")
    path = str(tmp_path / "socket")
    env = {**os.environ, "PYTHONPATH": f"{probe}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    server = subprocess.Popen([sys.executable, "-m", "colocate.resources.zygote", path,
                               "colorsys"], stdin=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=env)
    try:
        while not Path(path).exists():  # bound as it starts
            time.sleep(0.01)
        asked = {"PROBE_PRELOADED": "colorsys,wave,sets_env"}
        first = command(probe, path, **asked)
        assert said(first)["extra"] == ["colorsys"] and first.wait(30) == 3
        server.stdin.write(b"no_such_module\nwave\nsets_")  # as `preload` sends them,
        server.stdin.flush()                                  # a line cut in two
        time.sleep(0.5)
        server.stdin.write(b"env\n")
        server.stdin.flush()
        deadline = time.monotonic() + 30
        while True:  # the server reads its stdin between requests
            later = command(probe, path, **asked)
            got = said(later)
            assert later.wait(30) == 3
            if len(got["extra"]) == 3 or time.monotonic() > deadline:
                break
        assert got["extra"] == ["colorsys", "wave", "sets_env"]
        assert got["set_by_import"] == "imported"  # what the import set, the fork has
        mine = command(probe, path, PROBE_SET_BY_IMPORT="mine", **asked)
        assert said(mine)["set_by_import"] == "mine" and mine.wait(30) == 3  # its own wins
    finally:
        server.stdin.close()
        assert server.wait(30) == 0
    assert "cannot preload no_such_module" in server.stderr.read().decode()


def test_without_a_server_the_command_starts_the_proc_itself(probe, tmp_path):
    proc = command(probe, str(tmp_path / "nothing-here"))
    assert said(proc)["pid"] == proc.pid and proc.wait(30) == 3
    assert "no fork server" in proc.stderr.read()


async def test_a_runtime_on_this_machine_forks_its_procs_unless_told_not_to(monkeypatch):
    request = ResourceRequest("g", hosts=1, procs_per_host=2)
    async with start_runtime(gpus_per_host=2) as rm:
        await rm.allocate(request, owner="a")
        assert {psutil.Process(pid).ppid() for pid in rm.group("g").pids} == {
            zygote.server_pid()}
    monkeypatch.setenv(FORK_PROCS_ENV, "0")
    async with start_runtime(gpus_per_host=2) as rm:
        await rm.allocate(request, owner="a")
        assert zygote.server_pid() not in {psutil.Process(pid).ppid()
                                          for pid in rm.group("g").pids}
