"""Where a paused tag's contents wait, and what host memory those backups hold.

A pause of a tag with backup puts its contents in one of three places, which the caller
chooses (the arbiter, per switch, from its host's memory budget:
`colocate.arbiter.host_budget`):

- `HOST`: host memory. On CPU a plain anonymous mapping of exactly the tag's bytes (not
  rounded up to a power of two), freed at the resume; on CUDA the tag's pinned buffer
  (`pinned.py`, exact sizes too, held for the process's life).
- `DISK`: an unlinked file in the backup directory (`set_backup_dir`, else
  `$COLOCATE_BACKUP_DIR`, else the system temp dir), read back at the resume and kept for
  the tag's next backup to disk, which rewrites it. Put it on a disk, not tmpfs, or the
  bytes stay in RAM. CPU tags only.
- `DROP`: nothing is kept (what a tag without backup always does): the tag's owner refills
  it (a generator's weights that the next sync rewrites).

`BackupCount` is this process's count of host backup bytes: held now, and the most held
since it was last read, which a switch's answer carries to the arbiter.
"""

from __future__ import annotations

import os
import tempfile
import threading
from dataclasses import dataclass

HOST, DISK, DROP = "host", "disk", "drop"
PLACES = (HOST, DISK, DROP)


def backup_directory(path: str | None) -> str:
    """Where backups to disk go: `path`, else `$COLOCATE_BACKUP_DIR`, else the temp dir."""
    return path or os.environ.get("COLOCATE_BACKUP_DIR") or tempfile.gettempdir()


@dataclass(frozen=True)
class BackupReading:
    """This process's backups: host bytes held now and at most since the last reading,
    and bytes held on disk now."""

    host_bytes: int = 0
    peak_host_bytes: int = 0
    disk_bytes: int = 0


class BackupCount:
    """The running count of one process's backups (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held = {HOST: 0, DISK: 0}
        self._peak = 0

    def add(self, place: str, nbytes: int) -> None:
        """`nbytes` more are held at `place` (negative: freed)."""
        if place == DROP:
            return
        with self._lock:
            self._held[place] += nbytes
            self._peak = max(self._peak, self._held[HOST])

    def read(self, reset_peak: bool = False) -> BackupReading:
        """The count now; with `reset_peak`, the peak starts again from what is held."""
        with self._lock:
            found = BackupReading(self._held[HOST], self._peak, self._held[DISK])
            if reset_peak:
                self._peak = self._held[HOST]
            return found
