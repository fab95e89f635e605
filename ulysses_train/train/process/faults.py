"""Stopping well: preemption (SIGTERM), Ctrl-C, non-finite losses, and fault injection for the tests.

SIGTERM (what SLURM sends before preempting or at the time limit), the first Ctrl-C, and the watchdog's "the
launcher was stopped" only set a flag once training has started; the loop checks it after each optimizer step,
agrees across ranks (any rank signalled -> all stop), saves a checkpoint and exits 0, so a requeued job resumes
with `--resume auto`. A second Ctrl-C stops at once: a second SIGINT, not a Ctrl-C after another request. Under
DeepSpeed's launcher a Ctrl-C also ends the `deepspeed` command at once, and the watchdog can see it gone before
this rank runs its SIGINT handler (Python runs handlers between bytecodes, so a rank inside a long kernel or
collective runs it late); that Ctrl-C is still the first one, and the stop is named after the signal. Before
training starts there is nothing to save: the signal interrupts the start-up (`Interrupted`).

`ULYSSES_TRAIN_FAULT` injects a fault, for tests and drills only: `raise:STEP:RANK` raises on one rank at the
start of a step, `nan:STEP` makes that step's loss NaN, `kill:STEP` SIGKILLs rank 0 at the start of a step,
`kill_in_save:STEP` SIGKILLs rank 0 in the middle of that step's checkpoint, `enospc_in_save:STEP` fails that
save as a full disk would, `raise_in_reference:N` raises on every rank after the N-th micro-batch of DPO's
reference pass (the pass stopped part way, as a crash would). Three hold a run where a test sends a signal, so that the
outcome does not depend on how fast the run is: `hold_at:STEP` waits at the start of that step, on every rank, until the
rank is asked to stop (SIGTERM, Ctrl-C, the launcher gone), then goes on; `busy_at:STEP` waits there as a rank inside a
long kernel does, its signal handlers held back (SIGINT and SIGTERM blocked in the main thread), until the watchdog asks
it to stop (the launcher gone), and prints `busy at step STEP` on rank 0 once it waits; `hold_in_save` waits in the
middle of every checkpoint, on every rank, until a signal ends the process (a second Ctrl-C), and
`hold_in_save:STEP` only in that step's (a run with an intact checkpoint and one being written).
"""

from __future__ import annotations

import errno
import math
import os
import signal
import threading
import time

import torch
import torch.distributed as dist


class NonFiniteError(RuntimeError):
    """A NaN/inf loss or gradient; the message names the step."""


class Interrupted(BaseException):
    """SIGTERM or Ctrl-C before training started, or a second Ctrl-C: stop now, nothing to save. A BaseException,
    as KeyboardInterrupt is, so that no `except Exception` on the way swallows it."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


class StopFlag:
    """SIGTERM and SIGINT handlers, and the flag they set. `armed` once the training loop runs. `restore()` puts
    back the handlers that were there before (a run inside a process that goes on: the Python API). Only the main
    thread may install handlers; from another thread the run has none (the caller's own stay)."""

    def __init__(self):
        self.requested, self.reason, self.armed = False, None, False
        self.signalled = set()  # the signals handled while armed
        self.stopping = threading.Event()  # set with `requested` (faults' busy_at waits on it)
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._on_signal)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    interrupted_by = None  # the last Ctrl-C/SIGTERM this process saw: a peer's failure right after it is no fault

    def _on_signal(self, signum, frame):
        name = signal.Signals(signum).name
        StopFlag.interrupted_by = name
        if not self.armed or (signum == signal.SIGINT and signum in self.signalled):
            raise Interrupted(name)
        first = not self.signalled
        # counted before the message: a second Ctrl-C can run its handler inside this one (at any bytecode), and
        # must find the first one counted
        self.signalled.add(signum)
        if first:  # the signal names the stop, also when the watchdog saw its launcher go first
            self.requested, self.reason = True, f"{name} received"
            self.stopping.set()
        if first and os.environ.get("RANK", "0") == "0":
            again = "; Ctrl-C again stops at once" if signum == signal.SIGINT else ""
            os.write(2, f"{name}: finishing the current step and saving{again}\n".encode())

    def request(self, reason: str) -> None:
        """Stop after the current step and save (also from the watchdog's thread)."""
        if not self.requested:
            self.requested, self.reason = True, reason
            self.stopping.set()

    def agreed(self, device) -> bool:
        """Collective: True on every rank if any rank was signalled. Then every rank also takes the reason of the
        first rank that has one (a watchdog on one rank may be the only one to see its launcher go), so rank 0's
        log says why."""
        if not any_rank(self.requested, device):
            return False
        reasons = [None] * dist.get_world_size()
        dist.all_gather_object(reasons, self.reason)  # once a run, at its stop: every rank is here
        self.request(next((r for r in reasons if r is not None), "another rank stopped"))
        return True


def any_rank(condition: bool, device) -> bool:
    flag = torch.tensor(float(condition), device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def loss_is_skipped(loss: torch.Tensor, step: int, skip_nonfinite: bool) -> bool:
    """Collective: a non-finite loss on any rank stops every rank together (NonFiniteError), or with
    --skip_nonfinite skips the step on every rank (True)."""
    if inject_nan(step):
        loss = loss * float("nan")
    if not any_rank(not torch.isfinite(loss).item(), loss.device):
        return False
    if not skip_nonfinite:
        raise NonFiniteError(f"non-finite loss at step {step}: stopping (pass --skip_nonfinite to skip such steps; "
                             f"lower --lr or check the data)")
    return True


def check_grad_norm(grad_norm: float, step: int, skipped: bool, skip_nonfinite: bool) -> None:
    if not skipped and not math.isfinite(grad_norm) and not skip_nonfinite:
        raise NonFiniteError(f"non-finite gradient norm at step {step}: stopping (pass --skip_nonfinite to continue; "
                             f"DeepSpeed skips bf16 updates with overflowing gradients)")


def _fault():
    spec = os.environ.get("ULYSSES_TRAIN_FAULT", "")
    return spec.split(":") if spec else []


HOLD_POLL_S = 0.05


def _hold(until) -> None:
    """Waits (signal handlers run between the sleeps) until `until()` is true, or a handler raises."""
    while not until():
        time.sleep(HOLD_POLL_S)


def _busy(step: int, rank: int, stop: "StopFlag") -> None:
    """busy_at: this thread waits in C with SIGINT and SIGTERM blocked; the kernel gives them to another thread,
    whose C handler marks them for Python, which runs their handlers here once the wait is over."""
    held = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        if rank == 0:
            os.write(2, f"busy at step {step}\n".encode())
        stop.stopping.wait()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, held)


def inject_at_step(step: int, rank: int, stop: "StopFlag" = None) -> None:
    """Called at the start of each (1-based) step."""
    fault = _fault()
    if not fault or len(fault) < 2 or int(fault[1]) != step:
        return
    if fault[0] == "hold_at" and stop is not None:
        _hold(lambda: stop.requested)
    if fault[0] == "busy_at" and stop is not None:
        _busy(step, rank, stop)
    if fault[0] == "raise" and int(fault[2]) == rank:
        raise RuntimeError(f"injected failure on rank {rank} at step {step} (ULYSSES_TRAIN_FAULT)")
    if fault[0] == "kill" and rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)


def inject_nan(step: int) -> bool:
    fault = _fault()
    return bool(fault) and fault[0] == "nan" and int(fault[1]) == step


def inject_in_save(step: int, rank: int) -> None:
    """Called between writing a checkpoint's shards and marking it complete."""
    fault = _fault()
    if fault[:1] == ["hold_in_save"] and (len(fault) == 1 or int(fault[1]) == step):
        _hold(lambda: False)
    if len(fault) < 2 or int(fault[1]) != step or rank != 0:
        return
    if fault[0] == "kill_in_save":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault[0] == "enospc_in_save":
        raise OSError(errno.ENOSPC, "No space left on device (injected)")


def inject_in_reference(batches: int) -> None:
    """Called after each micro-batch of the reference pass (train/preference/reference_logps.py), on every rank."""
    fault = _fault()
    if fault[:1] == ["raise_in_reference"] and int(fault[1]) == batches:
        raise RuntimeError(f"injected failure after micro-batch {batches} of the reference pass "
                           f"(ULYSSES_TRAIN_FAULT)")
