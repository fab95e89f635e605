"""The output folder of a run: checked before any work, claimed by one run at a time, rolled back without loss.

- `check_writable`: before the model is built, rank 0 writes and removes a probe file where the run will write
  (`<output_dir>`, `<output_dir>/checkpoints`, or the nearest folder that exists on the way), so that an output
  folder that is a file or a read-only `checkpoints/` stops the run at once, naming the untouched previous
  checkpoint, instead of after hours of training at the first save.
- `claim_for_fresh_run`: a run without `--resume` into a folder that holds another run's checkpoints is refused:
  pruning, `latest` and `--resume auto` would otherwise mix the two runs. `--overwrite_output_dir` removes the
  previous run's `checkpoints/`, `metrics.jsonl` and `tensorboard/` (nothing else) and starts afresh.
- `abandon_newer`: resuming from step S makes S's line the current one. The checkpoints after S in
  `checkpoints/` move to `checkpoints/abandoned/rollback_to_step_S/` with a copy of `metrics.jsonl` as it was;
  `--resume auto` and pruning never look there, and the trainer never deletes it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Callable, Optional

from ...errors import ConfigError
from .checkpoint import (
    LATEST,
    STEP_PREFIX,
    checkpoint_name,
    checkpoint_step,
    checkpoints_dir,
    folder_step,
    newest_complete,
    state_step,
    write_text_atomically,
)

ABANDONED = "abandoned"
METRICS = "metrics.jsonl"
RUN_OUTPUTS = ("checkpoints", METRICS, "tensorboard")  # what --overwrite_output_dir removes


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_writable(output_dir: str) -> None:
    """ConfigError, naming the flag and the previous checkpoint, if the run could not write its outputs."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ConfigError(f"--output_dir {output_dir} is a file, not a folder: choose another --output_dir")
    root = checkpoints_dir(output_dir)
    if os.path.exists(root) and not os.path.isdir(root):
        raise ConfigError(f"--output_dir {output_dir}: {root} is not a folder: move it away or choose another "
                          f"--output_dir")
    for folder in dict.fromkeys([_nearest_existing(output_dir)] + ([root] if os.path.isdir(root) else [])):
        if not os.path.isdir(folder):
            raise ConfigError(f"--output_dir {output_dir}: {folder} is a file, not a folder: choose another "
                              f"--output_dir")
        try:
            handle, probe = tempfile.mkstemp(prefix=".write-probe-", dir=folder)
            os.close(handle)
            os.remove(probe)
        except OSError as e:
            previous = newest_complete(output_dir)
            kept = f"; the previous checkpoint {previous} is untouched" if previous else ""
            raise ConfigError(f"--output_dir {output_dir}: cannot write to {folder} ({e.strerror}){kept}: make it "
                              f"writable or choose another --output_dir") from None


def _step_folders(output_dir: str) -> list[str]:
    root = checkpoints_dir(output_dir)
    if not os.path.isdir(root):
        return []
    names = [n for n in os.listdir(root) if n.startswith(STEP_PREFIX) and n.removeprefix(STEP_PREFIX).isdigit()]
    return sorted(names, key=checkpoint_step)


def claim_for_fresh_run(output_dir: str, overwrite: bool, log: Callable[[str], None]) -> None:
    """A run starting at step 0: refuses a folder holding another run's checkpoints, or with --overwrite_output_dir
    removes that run's outputs."""
    previous = _step_folders(output_dir)
    if previous and not overwrite:
        raise ConfigError(f"--output_dir {output_dir} holds another run's checkpoints ({len(previous)}, the newest "
                          f"{previous[-1]}): continue that run with --resume auto, start afresh in this folder with "
                          f"--overwrite_output_dir (removes its checkpoints/, {METRICS} and tensorboard/), or choose "
                          f"another --output_dir")
    if not overwrite:
        return
    removed = [name for name in RUN_OUTPUTS if os.path.exists(os.path.join(output_dir, name))]
    for name in removed:
        path = os.path.join(output_dir, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    if removed:
        log(f"--overwrite_output_dir: removed the previous run's {', '.join(removed)} from {output_dir}")


def abandon_newer(output_dir: str, resumed: str, log: Callable[[str], None]) -> Optional[str]:
    """Moves the checkpoints after `resumed`'s step aside (with a copy of the metrics) and points `latest` at it;
    returns the folder they went to, or None if there were none."""
    step = state_step(resumed)  # its name may say nothing (best/)
    root = checkpoints_dir(output_dir)
    newer = [n for n in _step_folders(output_dir) if folder_step(os.path.join(root, n)) > step]
    if not newer:
        return None
    aside = base = os.path.join(root, ABANDONED, f"rollback_to_{checkpoint_name(step)}")
    copies = 1
    while os.path.exists(aside):
        copies += 1
        aside = f"{base}.{copies}"
    os.makedirs(aside)
    if os.path.exists(os.path.join(output_dir, METRICS)):  # before the resumed run truncates it to step S
        shutil.copy2(os.path.join(output_dir, METRICS), os.path.join(aside, METRICS))
    for name in newer:
        os.replace(os.path.join(root, name), os.path.join(aside, name))
    if os.path.dirname(os.path.abspath(resumed)) == os.path.abspath(root):
        write_text_atomically(os.path.join(root, LATEST), os.path.basename(resumed) + "\n")
    log(f"rollback to {resumed}: the newer checkpoints ({', '.join(newer)}) and a copy of {METRICS} are now in "
        f"{aside}; --resume auto never picks them and the trainer never deletes them")
    return aside
