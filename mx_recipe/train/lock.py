"""One run per job.output_dir: rank 0 holds an exclusive lock on ``<output_dir>/run.lock`` for the run's life.

The lock is ``flock`` on the open file, not the file's existence: the OS releases it when the process ends,
however it ends (``kill -9`` included), so a crash never leaves a stale lock and a requeued run starts
normally. The file keeps the pid and host of the run that took it last, for the message a second run gets.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path
from typing import IO

LOCK_FILE = "run.lock"


class RunLock:
    """Rank 0's hold on an output_dir. ``acquire`` takes it; ``release`` (or the process's end) gives it back."""

    def __init__(self) -> None:
        self._file: IO[str] | None = None
        self.unsupported: str | None = None  # why this file system could not lock, when it could not

    def acquire(self, output_dir: Path) -> str | None:
        """Take the lock without waiting: None when taken, else one line naming the run that holds it."""
        path = Path(output_dir) / LOCK_FILE
        try:
            f = open(path, "a+")  # created if missing; the holder's line is kept until the lock is ours
        except OSError as e:
            return f"job.output_dir: cannot create {path} ({e.strerror}): choose another job.output_dir"
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            return (
                f"job.output_dir {output_dir} is in use by the run of {holder} (it holds {path}): wait for that run "
                "to end or stop it, or choose another job.output_dir"
            )
        except OSError as e:  # a file system without locks (some NFS or Lustre mounts): run unguarded
            self.unsupported = f"cannot lock {path} ({e.strerror})"
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
        f.flush()
        self._file = f  # a forked child would share the lock: the trainer forks none (compile workers exec)
        return None

    def release(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
