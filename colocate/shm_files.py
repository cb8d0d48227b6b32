"""Shared-memory files that outlive the proc that made them: recorded by its pid, removed
by the runtime once that proc no longer runs.

A proc records each such file (`record`) before it makes it, in a small file named after
its pid; when the runtime stops or replaces procs it knows their pids, and
`remove_files_of(pids)` removes what each of them recorded, once it is gone. Only
recorded files are removed, and only those of a proc that no longer runs, so another
process's files (a live rank's, another runtime's) are never touched. A proc still running
then (one on a host just lost, that its node's end has not reached yet) is remembered, and
every later call removes its files once it has gone: the runtime's last stop sweeps what
its lost procs left.

What records: vLLM's CPU communicator (`colocate.engines.vllm_worker`), whose
per-rank files are removed only by its C++ destructor at a normal exit, so a killed
rank leaves them (8 MiB each on 2 CPU slots). A proc's switch-plan progress file
(`progress_path`, known by its pid: where a proc marks the step of the arbiter's plan it
is at, `colocate.arbiter.plan`) goes with them.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from colocate.telemetry import process_runs

_started = False  # whether this process wrote its record yet (the first write truncates)
_pending: set[int] = set()  # pids whose files were left because they still ran


def _records() -> Path:
    return Path(tempfile.gettempdir()) / f"colocate-shm-owners-{os.getuid()}"


def record(paths: Iterable[str | Path]) -> None:
    """Say that this process makes `paths` (call it before making them, so that a kill
    right after still leaves them found). A record left by an earlier process with the
    same pid is replaced."""
    global _started
    _records().mkdir(exist_ok=True)
    with open(_records() / str(os.getpid()), "a" if _started else "w") as out:
        out.writelines(f"{path}\n" for path in paths)
    _started = True


def recorded(pid: int) -> list[Path]:
    """The files process `pid` recorded (none when it recorded nothing)."""
    try:
        lines = (_records() / str(pid)).read_text().splitlines()
    except FileNotFoundError:
        return []
    return [Path(line) for line in dict.fromkeys(lines) if line]


def remove_files_of(pids: Iterable[int]) -> list[Path]:
    """Remove the files each of `pids` recorded, and its record, for those that no longer
    run; a running one's files are in use: left, and removed by a later call once it has
    gone. Returns the files removed."""
    removed = []
    for pid in dict.fromkeys([*pids, *sorted(_pending)]):
        if process_runs(pid):
            _pending.add(pid)
            continue
        _pending.discard(pid)
        for path in recorded(pid):
            try:
                path.unlink()
                removed.append(path)
            except FileNotFoundError:  # its owner removed it at exit
                pass
        (_records() / str(pid)).unlink(missing_ok=True)
        forget_progress(pid)
    return removed


def pending() -> tuple[int, ...]:
    """Procs whose files were left because they still ran at their `remove_files_of`."""
    return tuple(sorted(_pending))


PROGRESS_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def progress_path(pid: int) -> str:
    """The file where process `pid` marks the step its plan is at."""
    return os.path.join(PROGRESS_DIR, f"colocate-plan-{pid}")


def forget_progress(pid: int) -> None:
    """Remove process `pid`'s progress file (it ended)."""
    with contextlib.suppress(OSError):
        os.unlink(progress_path(pid))
