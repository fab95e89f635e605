"""GPU tests in parallel on one GPU (`pytest -n N tests/gpu`): each launch first takes the GiB its run plans, and
waits while the runs beside it hold so much that its own would not fit.

Why: the families' runs differ by 3x in memory (Llama 4's two layers plan 36 GiB, Qwen3-Next's 12.5 GiB); five
workers at once on an 80 GiB H100 failed two Llama 4 tests that pass alone (the failure text was lost; by these
plans, out of memory), while a 141 GiB H200 holds them all. The share is what our own planner says the run needs
(tools/plan_command.py, the same estimate as `python -m ulysses_train.plan -- <flags>`), with a margin for what it
leaves out (each process's CUDA context, the allocator's rounding). A run asking for more than the GPU has still
runs, alone.

The workers agree through a ledger file in the temp folder, one per GPU, under an exclusive lock: {pid: GiB} of
the runs on the GPU now; an entry whose process has gone is dropped."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import time
from pathlib import Path

from ulysses_train.data.token_store import process_alive
from ulysses_train.levers.policy import GiB

MARGIN = 1.2  # what the planner's estimate leaves out, as a share of it ...
CONTEXT_GIB = 2.0  # ... and per process: the CUDA context, cuBLAS's workspace, Triton's
GPU_SHARE = 0.95  # of the GPU's memory the ledger hands out
POLL_S = 2.0


def _plan(train_argv: list[str], seq_len: int):
    """launch/train.py with `train_argv` at `seq_len` on this GPU, as the planner resolves it: (GiB it plans on the
    GPU, the model's geometry)."""
    import torch

    from ulysses_train.levers.machine_constants import Constants
    from ulysses_train.tools.plan_command import Machine, command, evaluate

    machine = Machine(1, torch.cuda.get_device_properties(0).total_memory, 125 * GiB)
    run = command([*train_argv, "--seq_len", str(seq_len)], machine)
    return evaluate(run, machine, Constants()).memory["gpu_total"] / GiB, run.g


def planned_gib(train_argv: list[str], seq_len: int) -> float:
    """GiB on the GPU of launch/train.py with `train_argv` at `seq_len` on one GPU, by the planner, with the margin."""
    return _plan(train_argv, seq_len)[0] * MARGIN + CONTEXT_GIB


def verify_gib(train_argv: list[str], seq_len: int) -> float:
    """A `--verify` run at `seq_len`: the trainer's step, and beside it the larger of its two references, plain
    transformers in fp32 (the truth; the bf16 one comes after it is freed): weights and gradients (8 bytes a
    parameter), its fp32 logits and their gradient (8 bytes a logit), and one 1 GiB piece of the fp64
    cross-entropy with its gradient at a time (train/verify/reference_model.py: fp64_cross_entropy_sum)."""
    planned, g = _plan(train_argv, seq_len)
    reference = (8 * g["params"] + 8 * seq_len * g["vocab"]) / GiB + 2
    return (planned + reference) * MARGIN + CONTEXT_GIB


def _ledger() -> Path:
    import torch

    props = torch.cuda.get_device_properties(0)
    device = str(getattr(props, "uuid", "")) or props.name.replace(" ", "_")
    return Path(tempfile.gettempdir()) / f"ulysses-gpu-share-{os.getuid()}-{device}.json"


@contextlib.contextmanager
def _locked(path: Path):
    """The ledger {pid: GiB} under an exclusive lock; what the block leaves in it is written back."""
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        held = json.loads(path.read_text()) if path.exists() and path.stat().st_size else {}
        held = {pid: gib for pid, gib in held.items() if process_alive(int(pid))}
        yield held
        path.write_text(json.dumps(held))


@contextlib.contextmanager
def gpu_share(gib: float, what: str = "", capacity: float | None = None, ledger: Path | None = None):
    """Holds `gib` of this GPU's memory in the ledger while the block runs; waits until the runs beside leave room
    (or none runs). `capacity` (GiB) and `ledger`: this GPU's share of its memory and its ledger unless given."""
    if capacity is None:
        import torch

        capacity = GPU_SHARE * torch.cuda.get_device_properties(0).total_memory / GiB
    path, me = ledger or _ledger(), str(os.getpid())
    waited = 0.0
    while True:
        with _locked(path) as held:
            if not held or sum(held.values()) + gib <= capacity:
                held[me] = gib
                break
        time.sleep(POLL_S)
        waited += POLL_S
    if waited:
        print(f"{what}: waited {waited:.0f} s for {gib:.1f} GiB of the GPU's {capacity:.0f}")
    try:
        yield
    finally:
        with _locked(path) as held:
            held.pop(me, None)
