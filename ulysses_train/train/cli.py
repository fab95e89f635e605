"""`launch/train.py`: parse the flags, run them through the Python API (api.py: build the run, train it or
`--verify` it, release it), and exit with a code that says how it ended, with one message, once:

    0  done (or stopped by SIGTERM / the launcher going away, after saving; or nothing left to do)
    1  --verify outside tolerance
    2  a setting, path or data to change (ConfigError: also an unwritable --output_dir, or resume settings that
       differ from the checkpoint's), printed by rank 0
    3  anything else: a non-finite loss, a checkpoint that could not be written or is damaged, a frozen rank, an
       unexpected error
       (named with its rank; the traceback goes to <output_dir>/errors/rank_N.txt, and to the terminal with --debug)
       (CUDA out of memory: followed by a hint, the planner command on the run's flags and what lowers the peak)
  130  Ctrl-C before training started, or a second Ctrl-C

A rank that fails only because a peer stopped talking to it stays quiet: the peer that failed first has said why,
and that message stays the last word. Such a failure is recognised by where it came from, a collective (raised in
torch.distributed, or by the communication backend itself), and by what it says (the peer closed the connection);
the same words from anything else (a tracker's server refusing the connection) are this rank's own error.
A message printed by rank 0 for every rank is printed before any rank exits (report.py).
"""

from __future__ import annotations

import os
import re
import sys
import traceback

import torch
import torch.distributed as dist

from ..errors import CheckpointError, ConfigError
from .api import quiet_libraries, run
from .config.config_file import parse_args
from .process.faults import Interrupted, NonFiniteError, StopFlag
from .process.launcher import exit_now, normalise_launcher_env
from .process.report import report_once
from .run.memory_check import explicit_flags, run_flags

# what a collective raises when another rank died or left first: the other rank's own message says why
PEER_FAILURE_TEXTS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited",
                      "NCCL communicator was aborted", "Socket closed", "Connection refused")
# where collectives raise: torch.distributed's Python code, or the backend's C++ (its message starts with its source
# file: "[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer", as from Work.wait() of an async op)
DISTRIBUTED_DIR = os.path.dirname(os.path.abspath(dist.__file__)) + os.sep
BACKEND_SOURCE = re.compile(r"^\[[^\]]*(gloo|nccl|c10d|ProcessGroup)[^\]]*\]")


def _from_collective(error: BaseException) -> bool:
    """Whether `error` was raised by a collective (module docstring), not by this rank's own code."""
    if isinstance(error, dist.DistError):  # c10d's own types (NCCL's remote errors, the store, the network)
        return True
    frames = traceback.extract_tb(error.__traceback__)
    if frames and os.path.abspath(frames[-1].filename).startswith(DISTRIBUTED_DIR):
        return True
    return bool(BACKEND_SOURCE.match(str(error)))


def _peer_failure(error: BaseException) -> bool:
    """This rank's view of another rank's failure: a collective's error saying the peer went away."""
    return _from_collective(error) and any(t in str(error) for t in PEER_FAILURE_TEXTS)


def _interrupted(signal_name: str, rank: int) -> int:
    if rank == 0:
        print(f"stopped: {signal_name} (nothing to save)", file=sys.stderr, flush=True)
    return 130 if signal_name == "SIGINT" else 0


def _report_unexpected(error: BaseException, rank: int, cfg, flags: str = "") -> None:
    text = traceback.format_exc()
    debug = cfg is not None and cfg.log.debug
    if _peer_failure(error):  # not the cause: a peer's message says what happened
        if debug:
            print(f"[rank {rank}] stopped: a peer rank went away\n{text}", file=sys.stderr, flush=True)
        return
    where = os.path.join(cfg.output.output_dir, "errors", f"rank_{rank}.txt") if cfg is not None else None
    try:
        if where:
            os.makedirs(os.path.dirname(where), exist_ok=True)
            with open(where, "w") as f:
                f.write(text)
    except OSError:
        where = None
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    detail = text if debug else (f"(traceback in {where}; --debug prints it)" if where else f"\n{text}")
    print(f"error: rank {rank} failed: {type(error).__name__}: {first} {detail}", file=sys.stderr, flush=True)
    if isinstance(error, torch.OutOfMemoryError):  # each rank that ran out says it, with what to change
        print(out_of_memory_hint(flags), file=sys.stderr, flush=True)


def out_of_memory_hint(flags: str) -> str:
    """What to change after CUDA ran out of memory: the planner on this run's flags (`flags`: what it estimates and
    which levers fit), and the flags that lower the peak."""
    return ("hint: `python -m ulysses_train.plan --gpus N -- " + flags + "` estimates this run's memory "
            "and the levers and GPU count that fit it; what lowers the peak: --offload_activations, "
            "--checkpoint_layers all, --tiled_mlp on, a shorter --seq_len, more GPUs (--sp_size), or the optimizer "
            "states in host memory (--ds_config ds_configs/zero3_offload.json)")


def main(argv=None) -> int:
    """Runs the trainer (the Python API's `run`); never returns (see the exit codes above)."""
    quiet_libraries()
    normalise_launcher_env()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cfg, explicit = None, set()
    try:
        cfg, explicit = parse_args(argv)
        result = run(cfg, explicit, process_exits=True)
        code = 1 if result.verify is not None and not result.verify["passed"] else 0
    except SystemExit as e:  # --help
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except ConfigError as e:  # every rank hits the same check: one message, printed before any rank exits
        report_once(f"error: {e}", rank, world)
        code = 2
    except (NonFiniteError, CheckpointError) as e:  # raised on every rank together
        report_once(f"error: {e}", rank, world)
        code = 3
    except Interrupted as e:
        code = _interrupted(e.signal_name, rank)
    except BaseException as e:
        if StopFlag.interrupted_by == "SIGINT" and _peer_failure(e):  # Ctrl-C again: a peer stopped first
            code = _interrupted("SIGINT", rank)
        else:  # do not wait in collectives on the other ranks: the launcher tears them down
            _report_unexpected(e, rank, cfg, explicit_flags(cfg, explicit) if cfg is not None else run_flags(argv))
            code = 3
    exit_now(code)
