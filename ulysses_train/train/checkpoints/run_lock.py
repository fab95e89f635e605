"""One run per output folder: an exclusive lock on `<output_dir>/.lock`, held by rank 0 for the whole run.

Two runs writing into one folder replace each other's metrics and checkpoints (and, resumed, continue the wrong
run). The lock is `fcntl.flock`: the kernel drops it when its process ends however it ends, so a lock left by a
dead process is free, and its holder file (host, pid, start time, command) only tells the next run whose it was.
A run that ends through launcher.exit_now (done, a setting to change, an error, a signal) empties the holder file
first, so only a process that was killed leaves it filled, and the next run's "took over" warning means that.
On a network file system flock works across hosts where the server supports it (NFSv4 does); it is advisory, so it
protects runs of this trainer from each other, nothing more.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from typing import Optional

from ...errors import ConfigError
from ..process.launcher import at_exit
from .run_folder import check_writable

LOCK_NAME = ".lock"


class RunLock:
    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, LOCK_NAME)
        self.fd: Optional[int] = None

    def acquire(self) -> Optional[str]:
        """Takes the lock; returns a note when it takes over from a run that did not end cleanly. Raises a
        ConfigError naming the holder when a live run has it."""
        check_writable(os.path.dirname(self.path))  # a file, or a read-only folder: named before anything else
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(f"--output_dir {os.path.dirname(self.path)} cannot be written ({e.strerror}): choose "
                              f"another --output_dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise ConfigError(f"--output_dir {os.path.dirname(self.path)} is in use by another run ({holder}): wait "
                              f"for it to end, or choose another --output_dir") from None
        previous = _read_holder(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime(
            "%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}).encode(), 0)
        os.fsync(fd)
        self.fd = fd
        at_exit(self.release)
        if previous != "unknown run":
            return f"took over {self.path} from a run that did not end cleanly ({previous})"
        return None

    def release(self) -> None:
        """At a clean end: the holder file goes, then the lock (the kernel drops it anyway when the process ends)."""
        if self.fd is None:
            return
        os.ftruncate(self.fd, 0)
        os.close(self.fd)
        self.fd = None


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"null")
    except (OSError, ValueError):
        info = None
    if not isinstance(info, dict):
        return "unknown run"
    return f"pid {info.get('pid')} on {info.get('host')}, started {info.get('started')}: {info.get('command', '')}"
