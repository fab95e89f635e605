"""Reads rank and world from whichever launcher started the process (deepspeed, torchrun, accelerate launch,
srun, or none) and normalises them to the RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT variables
that `deepspeed.init_distributed` reads; and leaves the process without tearing the process groups down."""

from __future__ import annotations

import os
import re
import socket
import sys


def expand_nodelist(nodelist: str) -> list[str]:
    """Expands Slurm's compressed host list, e.g. 'gpu[01-03,7],login1' -> gpu01 gpu02 gpu03 gpu7 login1."""
    hosts = []
    for match in re.finditer(r"([^,\[]+)(\[([^\]]+)\])?", nodelist):
        prefix, ranges = match.group(1), match.group(3)
        if ranges is None:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{len(lo)}d}")
    return hosts


def free_port() -> int:
    """A TCP port free on this machine now (for a rendezvous on localhost)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def normalise_launcher_env(environ=os.environ) -> str:
    """Fills the torch.distributed variables in place; returns the name of the launcher detected, also left in
    ULYSSES_TRAIN_LAUNCHER (the watchdog does not watch the parent of a process the user started by hand)."""
    name = _normalise(environ)
    environ["ULYSSES_TRAIN_LAUNCHER"] = name
    return name


def _normalise(environ) -> str:
    if "RANK" in environ and "WORLD_SIZE" in environ:
        environ.setdefault("LOCAL_RANK", "0")
        return "torch-style (deepspeed / torchrun / accelerate)"
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        environ["RANK"] = environ["SLURM_PROCID"]
        environ["WORLD_SIZE"] = environ["SLURM_NTASKS"]
        environ["LOCAL_RANK"] = environ.get("SLURM_LOCALID", "0")
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        environ.setdefault("MASTER_ADDR", expand_nodelist(nodelist)[0])
        environ.setdefault("MASTER_PORT", str(29500 + int(environ.get("SLURM_JOB_ID", "0")) % 1000))
        return "srun"
    environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    environ.setdefault("MASTER_ADDR", "127.0.0.1")
    environ.setdefault("MASTER_PORT", str(free_port()))
    return "single process"


_AT_EXIT: list = []


def at_exit(callback) -> None:
    """`callback()` runs when exit_now ends the process, however the run ends (a lock's release: run_lock.py)."""
    _AT_EXIT.append(callback)


def exit_now(code: int) -> None:
    """Ends the process without the interpreter's teardown of the process groups: gloo's teardown of sub-groups now
    and then aborts a process that has finished its work ("terminate called without an active exception"), which
    would turn a clean exit into SIGABRT. Everything we write is closed and flushed before this point; what at_exit
    registered runs first."""
    for callback in _AT_EXIT:
        try:
            callback()
        except Exception:  # noqa: BLE001 - leaving anyway; the kernel drops what is left (a lock's flock)
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
