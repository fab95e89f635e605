"""Crash-safe checkpoints: DeepSpeed engine state (ZeRO-3 shards) plus our trainer state, saved atomically.

Layout under `<output_dir>/checkpoints/`:

    step_00000003/            one complete checkpoint
        ds/...                the DeepSpeed engine checkpoint (model, optimizer, scheduler; one shard per rank)
        trainer_state.json    step, data position, seed, run config
        rng/rank_<r>.pt       torch / CUDA / numpy / python RNG states (tensors and ints only)
        model/                config.json and tokenizer, for export
        COMPLETE              written last
    latest                    the name of the newest complete checkpoint

A checkpoint is written into a hidden `.tmp-step_N` folder, all ranks meet at a barrier, then rank 0 marks it
COMPLETE, renames it into place and only then replaces `latest` (write-to-temp, fsync, os.replace). A `kill -9`
at any point leaves `latest` naming the previous complete checkpoint. Loading runs DeepSpeed's `torch.load` calls
with `weights_only=True` and only the plain DeepSpeed data classes allowed (see `safe_loading`).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from .faults import inject_in_save

LATEST = "latest"
COMPLETE = "COMPLETE"


class CheckpointError(RuntimeError):
    pass


def checkpoints_dir(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def _fsync_write(path: str, text: str) -> None:
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
    root = checkpoints_dir(output_dir)
    if not os.path.isdir(root):
        return []
    names = [n for n in os.listdir(root) if n.startswith("step_") and os.path.exists(os.path.join(root, n, COMPLETE))]
    return [os.path.join(root, n) for n in sorted(names)]


def resolve_resume(resume: Optional[str], output_dir: str) -> Optional[str]:
    """--resume auto: the newest complete checkpoint named by `latest` (else the newest complete one), or None."""
    if not resume:
        return None
    if resume != "auto":
        if not os.path.exists(os.path.join(resume, COMPLETE)):
            raise CheckpointError(f"--resume {resume} is not a complete checkpoint (no {COMPLETE} marker)")
        return resume
    root = checkpoints_dir(output_dir)
    latest = os.path.join(root, LATEST)
    if os.path.exists(latest):
        candidate = os.path.join(root, open(latest).read().strip())
        if os.path.exists(os.path.join(candidate, COMPLETE)):
            return candidate
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


def save_checkpoint(engine, output_dir: str, step: int, trainer_state: dict, model_config, tokenizer,
                    rank: int, total_limit: Optional[int] = None) -> str:
    """Collective: every rank calls it. Returns the final checkpoint path."""
    root = checkpoints_dir(output_dir)
    name = f"step_{step:08d}"
    final, tmp = os.path.join(root, name), os.path.join(root, f".tmp-{name}")
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "rng"))
    dist.barrier()
    error = None
    try:
        engine.save_checkpoint(tmp, tag="ds")
        torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank_{rank}.pt"))
        inject_in_save(step, rank)
        if rank == 0:
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                json.dump(trainer_state, f, indent=1)
            model_config.save_pretrained(os.path.join(tmp, "model"))
            if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
                tokenizer.save_pretrained(os.path.join(tmp, "model"))
    except OSError as e:  # full disk, permissions: report clearly, keep the previous checkpoint
        error = f"rank {rank}: {e}"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    errors = [e for e in errors if e]
    if errors:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"saving checkpoint {name} failed ({'; '.join(errors)}); the previous checkpoint "
                              f"{resolve_resume('auto', output_dir) or '(none)'} is untouched")
    if rank == 0:
        _fsync_write(os.path.join(tmp, COMPLETE), f"{step}\n")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_write(os.path.join(root, LATEST), name + "\n")
        if total_limit:
            for old in complete_checkpoints(output_dir)[:-total_limit]:
                shutil.rmtree(old, ignore_errors=True)
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


def load_checkpoint(engine, path: str, rank: int) -> dict:
    """Restores engine, RNG and trainer state from a complete checkpoint; returns the trainer state."""
    with safe_loading():
        load_path, _ = engine.load_checkpoint(path, tag="ds", load_module_strict=True)
        rng = torch.load(os.path.join(path, "rng", f"rank_{rank}.pt"))
    if load_path is None:
        raise CheckpointError(f"DeepSpeed could not load {path}/ds")
    _set_rng_state(rng)
    with open(os.path.join(path, "trainer_state.json")) as f:
        return json.load(f)
