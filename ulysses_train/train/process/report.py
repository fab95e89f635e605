"""One message per run, even when every rank stops at once.

A setting to change (exit 2), a checkpoint that cannot be written or a non-finite loss (exit 3) stop every rank
together, and rank 0 prints the message. A launcher (DeepSpeed's launch.py, torchrun) ends every rank as soon as one
exits non-zero: a rank that left first could take rank 0's message with it, and the run would end with nothing
printed. So the other ranks wait until rank 0 has printed, through the rendezvous store at MASTER_ADDR:MASTER_PORT
(the process group's; before the process group exists, one rank 0 opens for this), and rank 0 leaves once they have
heard it. A rank that hears nothing within WAIT_S (rank 0 did not stop, or is gone) prints the message itself.
Having heard, the other ranks let rank 0 leave first (until the store it holds goes, at most LEAVE_WAIT_S): a
launcher reports the exit code of the first rank to leave and ends the rest, and a rank 1 that left first had
rank 0 ended mid-exit by a signal (1 settings error in 4, under the test that launches ranks as DeepSpeed does).
They watch for the store going with plain TCP connections, not the store's client: c10d's client logs each failed
request with a C++ stack trace on stderr, which would follow rank 0's one line on every other rank.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from datetime import timedelta

WAIT_S = 60.0  # a rank other than 0: how long it waits for rank 0's message before printing its own
HEARD_WAIT_S = 10.0  # rank 0: how long it waits for the others to have heard, before it leaves (and its store)
LEAVE_WAIT_S = 10.0  # another rank, having heard: how long it waits for rank 0 to leave first


def _key(what: str) -> str:
    return f"ulysses/report/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{what}"


def _address() -> tuple[str, int]:
    """The rendezvous store's host and port (KeyError, ValueError when the launcher set none)."""
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


def _store(rank: int):
    """A client of the rendezvous store, or on rank 0 before any process group its server; None if neither can
    be had (then every rank speaks for itself)."""
    import torch.distributed as dist

    try:
        host, port = _address()
        serve = (rank == 0 and not dist.is_initialized()
                 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true")  # torchrun's agent has it
        return dist.TCPStore(host, port, is_master=serve, timeout=timedelta(seconds=WAIT_S),
                             **({"wait_for_workers": False} if serve else {}))
    except Exception:  # noqa: BLE001 - the port taken, the host gone: no store, the message still gets out
        return None


def report_once(message: str, rank: int, world: int, stream=None) -> None:
    """Prints `message` once for the whole run (module docstring); every rank calls it with the same message."""
    stream = stream or sys.stderr
    if world <= 1:
        print(message, file=stream, flush=True)
        return
    if rank == 0:
        print(message, file=stream, flush=True)  # first: reaching the store can take its timeout
        store = _store(rank)
        if store is not None:
            _tell_and_wait(store, world)
        return
    store = _store(rank)
    if store is not None:
        try:
            store.wait([_key("printed")], timedelta(seconds=WAIT_S))
            store.add(_key("heard"), 1)
            _let_rank0_leave_first(*_address())
            return
        except Exception:  # noqa: BLE001 - rank 0 did not say it in time, or is gone: say it here
            pass
    print(f"[rank {rank}] {message}", file=stream, flush=True)


def _tell_and_wait(store, world: int) -> None:
    try:
        store.set(_key("printed"), "1")
        end = time.monotonic() + HEARD_WAIT_S
        while store.add(_key("heard"), 0) < world - 1 and time.monotonic() < end:
            time.sleep(0.02)
    except Exception:  # noqa: BLE001 - the others then print it themselves
        pass


def _let_rank0_leave_first(host: str, port: int) -> None:
    """Returns once the store stops taking connections (rank 0, which holds it under DeepSpeed's launcher and before
    any process group, has left) or after LEAVE_WAIT_S (a store held elsewhere, torchrun's agent: there the launcher
    ends this rank as soon as rank 0 has left)."""
    end = time.monotonic() + LEAVE_WAIT_S
    while time.monotonic() < end:
        try:
            with socket.create_connection((host, port), timeout=max(0.05, min(1.0, end - time.monotonic()))):
                pass
        except OSError:  # refused, reset or unreachable: the store went with rank 0
            return
        time.sleep(0.02)
