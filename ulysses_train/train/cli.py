"""`launch/train.py`: parse the flags, build the run, train it (or `--verify` it), and exit with a code that says
how it ended: 0 done (or nothing left to do), 1 an unexpected error (that rank's traceback), 2 a setting to change
(also an unwritable --output_dir, or resume settings that differ from the checkpoint's), 3 a non-finite loss or a
checkpoint that could not be written or is damaged."""

from __future__ import annotations

import os
import sys
import traceback

import torch.distributed as dist

from ..errors import CheckpointError, ConfigError
from .config import parse_args
from .faults import NonFiniteError
from .launcher import exit_now, normalise_launcher_env
from .loop import train
from .resume import NothingToDo
from .trainer import Trainer


def _quiet_libraries() -> None:
    import logging
    import warnings

    # torch renamed these collectives; DeepSpeed still calls the old names once per bucket, every step
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def _run(cfg, explicit: set[str], rank: int) -> int:
    trainer = Trainer(cfg, explicit)
    if cfg.verify:
        from .verify import verify

        code = verify(trainer)
    else:
        history = train(trainer)
        if rank == 0 and history:
            print(f"done: {history[-1]['step']} steps, loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}, "
                  f"metrics in {os.path.join(cfg.output_dir, 'metrics.jsonl')}", flush=True)
        code = 0
    dist.barrier()  # no rank leaves while another still talks to it
    return code


def main(argv=None) -> int:
    """Runs the trainer; never returns (exits with 0, 2 for settings, 3 for non-finite/checkpoint errors, 1 else;
    --verify: 0 within tolerance, 1 outside it)."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    _quiet_libraries()
    cfg, explicit = parse_args(argv)
    normalise_launcher_env()
    rank = int(os.environ.get("RANK", 0))
    try:
        code = _run(cfg, explicit, rank)
    except NothingToDo as e:  # the checkpoint is already at --steps: every rank knows it, rank 0 says it
        if rank == 0:
            print(e, flush=True)
        code = 0
    except ConfigError as e:
        # every rank hits the same check; one message is enough, every rank exits non-zero
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        code = 2
    except (NonFiniteError, CheckpointError) as e:  # raised on every rank together
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        code = 3
    except BaseException:
        # do not wait in collectives on the other ranks: the launcher tears them down
        print(f"[rank {rank}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        code = 1
    exit_now(code)
