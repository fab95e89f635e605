"""Nothing hangs: a frozen rank is named and every rank stops (`--dist_timeout`), and ranks whose launcher is gone
stop and save.

Heartbeats. Each rank's background thread adds 1 to its own counter in the rendezvous store of the default process
group every few seconds, and watches the counter of the next rank (rank + 1 mod world: every rank is watched by one
other, at the cost of one store read per beat, whatever the world size). A counter that has not moved for
`--dist_timeout` seconds means that rank is frozen (SIGSTOP, a debugger, a hung driver, swap): the watcher prints
which rank and on which host, and ends its own process with exit code 3; the launcher then ends the rest, and ranks
without a launcher see their peer gone. A store that does not answer for as long means rank 0, which holds it, is
frozen. The counters move from a thread, not from the training loop, so a long step (a 1M-token step takes minutes)
never trips it; what can is a process that does not run at all, or one C call holding the GIL for the whole timeout.
The default of 600 s is far above any call we make (the longest GIL-holding ones are file writes of checkpoints and
token caches, seconds) and reports a frozen rank in 10 minutes instead of the 30 of gloo's and NCCL's default
collective timeout, which we leave as it is: rank 0 may tokenize a corpus for longer than that while the others
wait, healthy. The watchdog talks to the store through a client of its own (`torch.distributed.TCPStore` at
MASTER_ADDR:MASTER_PORT) whose timeout bounds every call.

Launcher. `kill <pid>` of the `deepspeed` command kills that process only: its `launch.py` child and the ranks would
train on, orphaned. Each rank notes its parent (the launcher: torchrun's agent, DeepSpeed's launch.py) and, under
DeepSpeed's launcher, the `deepspeed` command above it; when either goes away the rank stops as on SIGTERM (the loop
saves after the current step and exits 0). The watch looks every LAUNCHER_POLL_S (two reads of /proc), between
heartbeats: the step saved is the one under way when the launcher went, not one a heartbeat later.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import Callable, Optional

DEFAULT_TIMEOUT_S = 600
LAUNCHER_POLL_S = 0.2


def _parent_of(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def launcher_chain() -> list[int]:
    """The processes whose death means the user stopped the run: the parent, and the `deepspeed` command above
    DeepSpeed's launch.py (killing `deepspeed` leaves launch.py running)."""
    parent = os.getppid()
    chain = [parent]
    if "deepspeed.launcher.launch" in _cmdline(parent):
        grandparent = _parent_of(parent)
        if grandparent and grandparent > 1:
            chain.append(grandparent)
    return chain


class Watchdog:
    """The heartbeat thread and the launcher watch of one rank; `stop_requested(reason)` is the loop's SIGTERM
    path (faults.StopFlag.request)."""

    def __init__(self, rank: int, world: int, timeout_s: float, stop_requested: Callable[[str], None],
                 exit_now: Callable[[int], None]):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.stop_requested, self.exit_now = stop_requested, exit_now
        self.beat_s = min(15.0, max(0.5, timeout_s / 10))
        self.watched = (rank + 1) % world
        launched = os.environ.get("ULYSSES_TRAIN_LAUNCHER", "single process") != "single process"
        self.chain = launcher_chain() if launched else []
        self.poll_s = min(self.beat_s, LAUNCHER_POLL_S) if self.chain else self.beat_s
        self.launcher_gone = False
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ulysses-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Ends the thread (at the end of a run inside a process that goes on: the Python API); it stops between
        beats, so this waits at most one store call."""
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        store = self._store()
        last_seen, moved_at, store_ok_at = None, time.monotonic(), time.monotonic()
        next_beat = time.monotonic()
        while not self._stopped.is_set():
            self._check_launcher()
            if store is not None and time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self.beat_s
                try:
                    store.add(f"ulysses/beat/{self.rank}", 1)
                    key = f"ulysses/beat/{self.watched}"
                    seen = int(store.get(key)) if store.check([key]) else 0
                    store_ok_at = time.monotonic()
                except Exception:  # noqa: BLE001 - a store that does not answer is what we watch for
                    seen = last_seen
                    if time.monotonic() - store_ok_at > self.timeout_s:
                        self._die(f"the rendezvous store on rank 0 ({os.environ.get('MASTER_ADDR')}:"
                                  f"{os.environ.get('MASTER_PORT')}) has not answered for {self.timeout_s:.0f} s: "
                                  f"rank 0 is frozen or gone")
                if seen != last_seen:
                    last_seen, moved_at = seen, time.monotonic()
                elif self.world > 1 and time.monotonic() - moved_at > self.timeout_s:
                    self._die(f"rank {self.watched} has not answered for {self.timeout_s:.0f} s (frozen, stopped or "
                              f"its host is gone): stopping every rank (--dist_timeout)")
            self._stopped.wait(self.poll_s)

    def _store(self):
        """A client of its own to the rendezvous store (MASTER_ADDR:MASTER_PORT, held by rank 0 or by torchrun's
        agent), so that its timeout bounds the watchdog's calls without touching the process group's."""
        if self.world == 1:
            return None
        from datetime import timedelta

        import torch.distributed as dist

        try:
            return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                 timeout=timedelta(seconds=self.timeout_s))
        except (KeyError, ValueError, RuntimeError) as e:
            print(f"[rank {self.rank}] watchdog off: the rendezvous store cannot be reached ({e})", file=sys.stderr,
                  flush=True)
            return None

    def _check_launcher(self) -> None:
        if self.launcher_gone or not self.chain:
            return
        parent_now = os.getppid()
        gone = parent_now != self.chain[0] or (len(self.chain) > 1 and _parent_of(self.chain[0]) != self.chain[1])
        if gone:
            self.launcher_gone = True
            self.stop_requested("the launcher was stopped")

    def _die(self, message: str) -> None:
        print(f"error: rank {self.rank} on {socket.gethostname()}: {message}", file=sys.stderr, flush=True)
        self.exit_now(3)
