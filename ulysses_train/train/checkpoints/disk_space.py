"""Room for checkpoints: a save checked against the free space before it writes, and a failed save named for what
it usually is.

A checkpoint of a run takes about the same space every time (the ZeRO shards: weights, master copy and optimizer
state), so the previous checkpoint's size, from its manifest, is the known size of the next one. Before each save,
rank 0 compares it with the free space of the checkpoints' file system and refuses a save that cannot fit (a full
disk mid-save ends in torch's zip writer as `RuntimeError: [enforce fail at inline_container.cc] . unexpected pos`,
not an OSError, after filling the disk). Before the first save there is only an estimate (parameters x (bytes per
weight + 12 for Adam's fp32 master and moments)); it warns, never refuses. A --use_peft run saves only what it
trains (the adapters and the modules trained whole: the frozen base is rebuilt on resume) and PEFT's adapter file of
them in fp32, so its estimate counts the trained parameters alone, 4 bytes more each. After a save, a warning says
when the next one will not fit.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from typing import Optional

from .manifest import MANIFEST

BLOCK = 4096  # files take whole blocks
SLACK = 256 << 10  # the markers, the manifest, `latest`
NEARLY_FULL = 64 << 20  # below this, a failed write is most likely the full disk
ADAM_BYTES = 12  # fp32 master copy, first and second moments
ADAPTER_FILE_BYTES = 4  # a --use_peft checkpoint's adapter_model.safetensors: the trained values in fp32


def size_text(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} bytes"


def checkpoint_bytes(folder: Optional[str]) -> Optional[int]:
    """The space the checkpoint in `folder` takes, from its manifest's file sizes; None without one."""
    if not folder:
        return None
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            sizes = [int(entry["size"]) for entry in json.load(f)["files"].values()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return sum(math.ceil(size / BLOCK) * BLOCK for size in sizes) + SLACK


def estimated_checkpoint_bytes(parameters: int, bytes_per_weight: int, adapters: bool = False) -> int:
    """What a checkpoint of `parameters` parameters trained with Adam takes, about (module docstring); `adapters`:
    of a --use_peft run, whose `parameters` are the trained ones only, saved with PEFT's adapter file."""
    return parameters * (bytes_per_weight + ADAM_BYTES + (ADAPTER_FILE_BYTES if adapters else 0)) + SLACK


def saved_parameters(module, adapters: bool) -> int:
    """The parameters a checkpoint holds: every one, or under --use_peft the trained ones
    (train/checkpoints/checkpoint.py leaves the frozen base out). Tied weights count once."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters() if p.requires_grad or not adapters)


def free_bytes(path: str) -> int:
    """Free space of the file system `path` is (or will be) on."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def too_little_space(root: str, need: Optional[int], what: str) -> Optional[str]:
    """Why a checkpoint of `need` bytes cannot be written under `root`, or None (also when `need` is unknown)."""
    if need is None:
        return None
    free = free_bytes(root)
    if free >= need:
        return None
    return (f"No space left on device for it: the file system of {root} has {size_text(free)} free and a checkpoint "
            f"of this run takes {size_text(need)} ({what}); free space, keep fewer checkpoints (--save_total_limit) "
            f"or choose another --output_dir")


def full_disk_note(root: str, need: Optional[int]) -> str:
    """After a write failed: ' (no space left on device: ...)' when the file system is (nearly) full, else ''."""
    try:
        free = free_bytes(root)
    except OSError:
        return ""
    if free < NEARLY_FULL or (need is not None and free < need):
        return f" (no space left on device: {size_text(free)} free on the file system of {root})"
    return ""


def remove_stale_temporaries(root: str, prefix: str) -> None:
    """Temporary folders of saves that never finished (a kill -9 mid-save): one run writes into a folder at a time
    (run_lock.py), so any left when a save starts are dead weight on the disk."""
    if os.path.isdir(root):
        for name in os.listdir(root):
            if name.startswith(prefix):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
