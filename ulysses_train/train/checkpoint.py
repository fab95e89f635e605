"""Crash-safe checkpoints: DeepSpeed engine state (ZeRO-3 shards) plus our trainer state, saved atomically.

Layout under `<output_dir>/checkpoints/`:

    step_00000003/            one complete checkpoint
        ds/...                the DeepSpeed engine checkpoint (model, optimizer, scheduler; one shard per rank)
        trainer_state.json    step, data position, seed, run config and the settings compared on resume
        rng/rank_<r>.pt       torch / CUDA / numpy / python RNG states (tensors and ints only)
        model/                config.json and tokenizer, for export (with --use_peft also PEFT's
                              adapter_config.json and adapter_modules.json: model/adapters.py)
        MANIFEST.json         every file above with its size and hash (manifest.py)
        COMPLETE              written last
    latest                    the name of the newest complete checkpoint (for people and tools)
    abandoned/                checkpoints of lines given up by a rollback (run_folder.py); never resumed from

With --use_peft the DeepSpeed checkpoint leaves out the frozen base weights (`exclude_frozen_parameters`): it holds
the adapters, the modules trained whole and their optimizer states, so it is small; resuming rebuilds the base from
--model (or the seeded initialisation) exactly as the run first built it.

A checkpoint is written into a hidden `.tmp-step_N` folder, all ranks meet, then rank 0 writes the manifest, marks
it COMPLETE, renames it into place and only then replaces `latest` (write-to-temp, fsync, os.replace). A `kill -9`
at any point leaves the previous complete checkpoint as the newest. An error on any rank (full disk, permissions)
is agreed by every rank and raised everywhere as a CheckpointError naming the untouched previous checkpoint.

`--resume auto` takes the newest complete checkpoint whose files match its manifest, warning about each newer
damaged one. `--save_total_limit K` keeps the K newest checkpoints up to the one just written, which is never
removed. Loading runs DeepSpeed's `torch.load` calls with `weights_only=True` and only the plain DeepSpeed data
classes allowed (see `safe_loading`).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from ..errors import CheckpointError
from .faults import inject_in_save
from .manifest import complete_marker, damage, verify_checkpoint, write_manifest

LATEST = "latest"
COMPLETE = "COMPLETE"
TRAINER_STATE = "trainer_state.json"
STEP_PREFIX = "step_"

__all__ = ["CheckpointError", "COMPLETE", "LATEST", "checkpoints_dir", "complete_checkpoints", "resolve_resume",
           "read_trainer_state", "save_checkpoint", "write_text_atomically", "load_checkpoint", "prune_checkpoints",
           "safe_loading"]


def checkpoints_dir(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def checkpoint_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def checkpoint_step(path: str) -> int:
    return int(os.path.basename(os.path.normpath(path)).removeprefix(STEP_PREFIX))


def write_text_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rng_state() -> dict:
    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
             "numpy_meta": [np_state[2], np_state[3], np_state[4]], "python": list(random.getstate()[1]),
             "python_meta": [random.getstate()[0], random.getstate()[2]]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    keys = state["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, *state["numpy_meta"]))
    random.setstate((state["python_meta"][0], tuple(state["python"]), state["python_meta"][1]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def complete_checkpoints(output_dir: str) -> list[str]:
    """The complete checkpoints of the current line (the top level of checkpoints/), oldest first."""
    root = checkpoints_dir(output_dir)
    if not os.path.isdir(root):
        return []
    names = [n for n in os.listdir(root) if n.startswith(STEP_PREFIX) and n.removeprefix(STEP_PREFIX).isdigit()
             and os.path.exists(os.path.join(root, n, COMPLETE))]
    return [os.path.join(root, n) for n in sorted(names, key=checkpoint_step)]


def newest_complete(output_dir: str) -> Optional[str]:
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


def resolve_resume(resume: Optional[str], output_dir: str, warn: Callable[[str], None]) -> Optional[str]:
    """The checkpoint to resume from, verified against its manifest. --resume PATH: that one, or a CheckpointError
    naming what is damaged. --resume auto: the newest intact complete checkpoint of the current line (`warn` is told
    about each newer damaged one), None if there is none at all, a CheckpointError if all are damaged: starting
    over from step 0 would silently throw the run away."""
    if not resume:
        return None
    if resume != "auto":
        if not os.path.exists(os.path.join(resume, COMPLETE)):
            raise CheckpointError(f"--resume {resume} is not a complete checkpoint (no {COMPLETE} marker)")
        verify_checkpoint(resume)
        return resume
    damaged = []
    for path in reversed(complete_checkpoints(output_dir)):
        problem = damage(path)
        if problem is None:
            for bad, what in damaged:
                warn(f"{bad} is damaged ({what}); resuming from the newest intact checkpoint, {path}")
            return path
        damaged.append((path, problem))
    if damaged:
        raise CheckpointError(f"--resume auto: no intact checkpoint in {checkpoints_dir(output_dir)} ("
                              + "; ".join(f"{p}: {w}" for p, w in damaged) + "); restore the named files, or "
                              "start afresh with --overwrite_output_dir")
    return None


def read_trainer_state(path: str) -> dict:
    """The trainer state of checkpoint `path`; a missing or unreadable file is a CheckpointError naming it."""
    file = os.path.join(path, TRAINER_STATE)
    try:
        with open(file) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing: {path} is damaged; resume from another checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON ({e}): {path} is damaged; resume from another "
                              f"checkpoint") from None


def prune_checkpoints(output_dir: str, keep: int, saved_step: int) -> list[str]:
    """Keeps the checkpoint of `saved_step` and the keep - 1 newest before it; returns what was removed. Newer
    ones (there are none on the current line: a rollback moves them aside) are not this function's to judge."""
    older = [p for p in complete_checkpoints(output_dir) if checkpoint_step(p) < saved_step]
    doomed = older[:max(0, len(older) - (keep - 1))]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def _attempt(action: Callable[[], None], rank: int, only_rank0: bool = False) -> Optional[str]:
    """Runs `action` (on rank 0 only, if asked); returns its OSError as text instead of raising it."""
    if only_rank0 and rank != 0:
        return None
    try:
        action()
    except OSError as e:  # full disk, permissions: reported by every rank together
        return f"rank {rank}: {e}"
    return None


def _agree(error: Optional[str], name: str, previous: Optional[str], tmp: str, rank: int) -> None:
    """Collective: every rank raises if any rank failed, naming the untouched previous checkpoint."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    errors = [e for e in errors if e]
    if errors:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"saving checkpoint {name} failed ({'; '.join(errors)}); the previous checkpoint "
                              f"{previous or '(none)'} is untouched")


def _write_files(engine, tmp: str, step: int, trainer_state: dict, model_config, tokenizer, rank: int,
                 adapters=None, base_model: Optional[str] = None) -> None:
    engine.save_checkpoint(tmp, tag="ds", exclude_frozen_parameters=adapters is not None)
    torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank_{rank}.pt"))
    inject_in_save(step, rank)
    if rank == 0:
        write_text_atomically(os.path.join(tmp, TRAINER_STATE), json.dumps(trainer_state, indent=1))
        model_config.save_pretrained(os.path.join(tmp, "model"))
        if adapters is not None:
            from ..model.adapters import save_adapter_config

            save_adapter_config(adapters, os.path.join(tmp, "model"), base_model)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(os.path.join(tmp, "model"))


def save_checkpoint(engine, output_dir: str, step: int, trainer_state: dict, model_config, tokenizer,
                    rank: int, total_limit: Optional[int] = None, adapters=None, base_model: Optional[str] = None
                    ) -> str:
    """Collective: every rank calls it. Returns the final checkpoint path. `adapters` (model/adapters.py): save
    only what is trained, and the adapters' config (with `base_model`, the --model they were trained on)."""
    root = checkpoints_dir(output_dir)
    name = checkpoint_name(step)
    final, tmp = os.path.join(root, name), os.path.join(root, f".tmp-{name}")
    previous = newest_complete(output_dir)

    def prepare():
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "rng"))

    def publish():
        write_manifest(tmp)
        write_text_atomically(os.path.join(tmp, COMPLETE), complete_marker(step))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        write_text_atomically(os.path.join(root, LATEST), name + "\n")

    _agree(_attempt(prepare, rank, only_rank0=True), name, previous, tmp, rank)
    _agree(_attempt(lambda: _write_files(engine, tmp, step, trainer_state, model_config, tokenizer, rank, adapters,
                                         base_model), rank),
           name, previous, tmp, rank)
    _agree(_attempt(publish, rank, only_rank0=True), name, previous, tmp, rank)
    if rank == 0 and total_limit:
        prune_checkpoints(output_dir, total_limit, step)
    dist.barrier()
    return final


# DeepSpeed checkpoints hold tensors, plain containers and a few DeepSpeed enums/records; nothing else may load.
def _deepspeed_safe_globals() -> list:
    allowed = []
    for module, names in (("deepspeed.runtime.zero.config", ["ZeroStageEnum"]),
                          ("deepspeed.runtime.fp16.loss_scaler", ["LossScaler", "DynamicLossScaler"]),
                          ("deepspeed.utils.tensor_fragment", ["fragment_address"]),
                          ("deepspeed.runtime.zero.offload_config", ["OffloadDeviceEnum"])):
        with contextlib.suppress(ImportError, AttributeError):
            mod = __import__(module, fromlist=names)
            allowed += [getattr(mod, n) for n in names if hasattr(mod, n)]
    return allowed


@contextlib.contextmanager
def safe_loading():
    """Makes every torch.load inside the block (DeepSpeed's included) use weights_only=True."""
    original = torch.load

    def load(*args, **kwargs):
        kwargs["weights_only"] = True
        return original(*args, **kwargs)

    torch.load = load
    try:
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            yield
    finally:
        torch.load = original


def load_checkpoint(engine, path: str, rank: int, adapters_only: bool = False) -> dict:
    """Restores engine, RNG and trainer state from a complete checkpoint (verified by rank 0 before: see
    resume.plan_run); returns the trainer state. `adapters_only`: a --use_peft checkpoint, which holds no frozen
    weight (they stay as built)."""
    with safe_loading():
        load_path, _ = engine.load_checkpoint(path, tag="ds", load_module_strict=not adapters_only)
        rng = torch.load(os.path.join(path, "rng", f"rank_{rank}.pt"))
    if load_path is None:
        raise CheckpointError(f"DeepSpeed could not load {path}/ds")
    _set_rng_state(rng)
    return read_trainer_state(path)
