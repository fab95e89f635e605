"""`launch/train.py`: parse the flags, run them through the Python API (api.py: build the run, train it or
`--verify` it, release it), and exit with a code that says how it ended, with one message, once:

    0  done (or stopped by SIGTERM / the launcher going away, after saving; or nothing left to do)
    1  --verify outside tolerance
    2  a setting, path or data to change (ConfigError: also an unwritable --output_dir, or resume settings that
       differ from the checkpoint's), printed by rank 0
    3  anything else: a non-finite loss, a checkpoint that could not be written or is damaged, a frozen rank, an
       unexpected error
       (named with its rank; the traceback goes to <output_dir>/errors/rank_N.txt, and to the terminal with --debug)
  130  Ctrl-C before training started, or a second Ctrl-C

A rank that fails only because a peer stopped talking to it (gloo's "Connection closed by peer", NCCL's remote
errors) stays quiet: the peer that failed first has said why, and that message stays the last word.
"""

from __future__ import annotations

import os
import sys
import traceback

from ..errors import CheckpointError, ConfigError
from .api import run
from .config import parse_args
from .faults import Interrupted, NonFiniteError, StopFlag
from .launcher import exit_now, normalise_launcher_env

# what a rank sees when another rank died or left first: the other rank's own message says why
PEER_FAILURE_TEXTS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited",
                      "NCCL communicator was aborted", "Socket closed", "Connection refused")


def _peer_failure(error: BaseException) -> bool:
    return any(t in str(error) for t in PEER_FAILURE_TEXTS)


def _interrupted(signal_name: str, rank: int) -> int:
    if rank == 0:
        print(f"stopped: {signal_name} (nothing to save)", file=sys.stderr, flush=True)
    return 130 if signal_name == "SIGINT" else 0


def _report_unexpected(error: BaseException, rank: int, cfg) -> None:
    text = traceback.format_exc()
    if _peer_failure(error):  # not the cause: a peer's message says what happened
        if cfg.debug:
            print(f"[rank {rank}] stopped: a peer rank went away\n{text}", file=sys.stderr, flush=True)
        return
    where = os.path.join(cfg.output_dir, "errors", f"rank_{rank}.txt")
    try:
        os.makedirs(os.path.dirname(where), exist_ok=True)
        with open(where, "w") as f:
            f.write(text)
    except OSError:
        where = None
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    detail = text if cfg.debug else (f"(traceback in {where}; --debug prints it)" if where else "(--debug prints "
                                                                                               "the traceback)")
    print(f"error: rank {rank} failed: {type(error).__name__}: {first} {detail}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    """Runs the trainer (the Python API's `run`); never returns (see the exit codes above)."""
    cfg, explicit = parse_args(argv)
    normalise_launcher_env()
    rank = int(os.environ.get("RANK", 0))
    try:
        result = run(cfg, explicit)
        code = 1 if result.verify is not None and not result.verify["passed"] else 0
    except ConfigError as e:
        # every rank hits the same check; one message is enough, every rank exits non-zero
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        code = 2
    except (NonFiniteError, CheckpointError) as e:  # raised on every rank together
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        code = 3
    except Interrupted as e:
        code = _interrupted(e.signal_name, rank)
    except BaseException as e:
        if StopFlag.interrupted_by == "SIGINT" and _peer_failure(e):  # Ctrl-C again: a peer stopped first
            code = _interrupted("SIGINT", rank)
        else:  # do not wait in collectives on the other ranks: the launcher tears them down
            _report_unexpected(e, rank, cfg)
            code = 3
    exit_now(code)
