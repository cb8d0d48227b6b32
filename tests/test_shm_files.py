"""`colocate.shm_files` in plain processes: a proc's recorded shared-memory files
go once it is killed, a live process's recorded files and unrecorded files stay (and go
at a later call, for any pids, once it has ended), and a record left under a reused pid does
not survive its new owner's first record."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from colocate import shm_files

SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
pytestmark = pytest.mark.skipif(SHM is None, reason="no /dev/shm")


def make_and_hold(path: str, stale: str, ready) -> None:
    """A proc that finds a record of an earlier process with its pid, records `path`,
    makes it, and holds on until it is killed."""
    records = shm_files._records()
    records.mkdir(exist_ok=True)
    (records / str(os.getpid())).write_text(f"{stale}\n")
    shm_files.record([path])
    Path(path).write_bytes(b"x" * 4096)
    ready.set()
    time.sleep(120)


def test_a_killed_procs_recorded_files_go_and_no_one_elses():
    context = multiprocessing.get_context("spawn")
    tag = uuid.uuid4().hex[:8]
    killed, alive, unrecorded, stale = (SHM / f"colocate-test-{tag}-{name}"
                                        for name in ("killed", "alive", "unrecorded", "stale"))
    unrecorded.write_bytes(b"y")
    stale.write_bytes(b"z")  # recorded by "an earlier process" with the killed one's pid
    procs = []
    try:
        for path in (killed, alive):
            ready = context.Event()
            proc = context.Process(target=make_and_hold, args=(str(path), str(stale), ready))
            proc.start()
            assert ready.wait(60)
            procs.append(proc)
        assert shm_files.recorded(procs[0].pid) == [killed]  # the stale record replaced
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].join(30)
        assert killed.exists()  # nothing of its own removed it
        removed = shm_files.remove_files_of([procs[0].pid, procs[1].pid])
        assert removed == [killed] and not killed.exists()
        assert alive.exists() and unrecorded.exists() and stale.exists()
        assert shm_files.recorded(procs[0].pid) == []  # its record went too
        assert shm_files.recorded(procs[1].pid) == [alive]  # still running: kept
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].join(30)
        # a later call for other procs sweeps it: it was left while it still ran
        assert shm_files.remove_files_of([]) == [alive]
        assert shm_files.remove_files_of([]) == []  # once
    finally:
        for proc in procs:
            proc.kill()
            proc.join(30)
        for path in (killed, alive, unrecorded, stale):
            path.unlink(missing_ok=True)
        for proc in procs:
            (shm_files._records() / str(proc.pid)).unlink(missing_ok=True)


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/proc/self/ns/pid").exists(),
                    reason="a PID namespace of its own needs root and Linux")
def test_a_pid_is_only_signalled_on_the_machine_it_names():
    """A proc in another PID namespace (as on another host) reads as elsewhere: the runtime
    does not kill by its pid here; a proc of this namespace reads as here."""
    import subprocess
    import sys

    from colocate.resources.procs import machine_id

    ask = [sys.executable, "-c", "from colocate.resources.procs import machine_id; "
                                 "print(machine_id())"]
    same = subprocess.run(ask, capture_output=True, text=True, check=True).stdout.strip()
    other = subprocess.run(["unshare", "--pid", "--fork", *ask], capture_output=True,
                           text=True, check=True).stdout.strip()
    assert same == machine_id() and other and other != same
