"""Crash-safe checkpoints: DeepSpeed engine state (ZeRO-3 shards) plus our trainer state, saved atomically.

Layout under `<output_dir>/checkpoints/`:

    step_00000003/            one complete checkpoint
        ds/...                the DeepSpeed engine checkpoint (model, optimizer, scheduler; one shard per rank)
        trainer_state.json    step, data position, seed, run config and the settings compared on resume
        rng/rank_<r>.pt       torch / CUDA / numpy / python RNG states (tensors and ints only)
        model/                config.json and tokenizer, for export (with --use_peft also PEFT's
                              adapter_config.json and adapter_modules.json: model/adapters.py)
        adapter_config.json   with --use_peft: PEFT's adapter folder (and adapter_model.safetensors, the trained
                              values in fp32), for PeftModel.from_pretrained(base, <this folder>)
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
import errno
import json
import os
import random
import shutil
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from ...errors import CheckpointError, ConfigError
from ..process.faults import inject_in_save
from .disk_space import checkpoint_bytes, full_disk_note, remove_stale_temporaries, too_little_space
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


def _is_step(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def state_step(path: str) -> int:
    """The step trainer_state.json of checkpoint `path` says it holds: a CheckpointError naming the file unless it
    is a whole number >= 0."""
    step = read_trainer_state(path).get("step")
    if not _is_step(step):
        raise CheckpointError(f"{os.path.join(path, TRAINER_STATE)} says step {step!r}, not a step of a run (a whole "
                              f"number >= 0): {path} is damaged; resume from another checkpoint")
    return step


def identity_problem(path: str) -> Optional[str]:
    """Why the folder `path` is not the checkpoint its name says, or None: a symbolic link (its files live
    elsewhere), a trainer_state.json whose step is no step (`"step": -3`), or a step_N folder whose
    trainer_state.json holds another step (a copy, or a renamed folder). Such a folder is never taken for a
    checkpoint of this run: `cp -r step_3 step_99` would be its newest for ever. A trainer_state.json that cannot
    be read is no identity problem: the manifest check names it as damage."""
    if os.path.islink(os.path.normpath(path)):
        return f"a symbolic link to {os.path.realpath(path)}, not a checkpoint folder of this run"
    try:
        step = read_trainer_state(path).get("step")
    except CheckpointError:
        return None
    if not _is_step(step):
        return f"its {TRAINER_STATE} says step {step!r}, not a step of a run (a whole number >= 0)"
    name = os.path.basename(os.path.normpath(path))
    if name.startswith(STEP_PREFIX) and name.removeprefix(STEP_PREFIX).isdigit() and checkpoint_step(path) != step:
        return f"its {TRAINER_STATE} holds step {step}, not the step its name says (a copy or a renamed folder?)"
    return None


def folder_step(path: str) -> int:
    """The step of a checkpoint folder: its trainer_state.json's, or where that cannot be read, its name's."""
    try:
        return state_step(path)
    except CheckpointError:
        return checkpoint_step(path)


def complete_checkpoints(output_dir: str, warn: Optional[Callable[[str], None]] = None) -> list[str]:
    """The complete checkpoints of the current line (the top level of checkpoints/), ordered by the step their
    trainer_state.json holds, oldest first. A folder that is not what its name says (identity_problem) is left out,
    and named to `warn`."""
    root = checkpoints_dir(output_dir)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if not (name.startswith(STEP_PREFIX) and name.removeprefix(STEP_PREFIX).isdigit()
                and os.path.exists(os.path.join(path, COMPLETE))):
            continue
        problem = identity_problem(path)
        if problem is None:
            found.append((folder_step(path), path))
        elif warn is not None:
            warn(f"{path} is left out: {problem}")
    return [path for _, path in sorted(found)]


def newest_complete(output_dir: str) -> Optional[str]:
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


def _checked_resume_path(resume: str) -> str:
    """--resume PATH: a complete checkpoint folder (any name: best/ works), intact, that is what its name says."""
    if os.path.islink(os.path.normpath(resume)):
        raise ConfigError(f"--resume {resume} is a symbolic link (to {os.path.realpath(resume)}): give the checkpoint "
                          f"folder itself")
    if not os.path.exists(os.path.join(resume, COMPLETE)):
        raise CheckpointError(f"--resume {resume} is not a complete checkpoint (no {COMPLETE} marker)")
    verify_checkpoint(resume)
    problem = identity_problem(resume)
    if problem:
        raise CheckpointError(f"--resume {resume}: {problem}")
    state_step(resume)  # readable, and a step
    return resume


def resolve_resume(resume: Optional[str], output_dir: str, warn: Callable[[str], None]) -> Optional[str]:
    """The checkpoint to resume from, verified against its manifest. --resume PATH: that one, or an error naming
    what is wrong with it. --resume auto: the newest intact complete checkpoint of the current line (`warn` is told
    about each newer damaged one, and each folder left out), None if there is none at all, a CheckpointError if
    all are damaged: starting over from step 0 would silently throw the run away."""
    if not resume:
        return None
    if resume != "auto":
        return _checked_resume_path(resume)
    damaged = []
    for path in reversed(complete_checkpoints(output_dir, warn)):
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
            state = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing: {path} is damaged; resume from another checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON ({e}): {path} is damaged; resume from another "
                              f"checkpoint") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{file} does not hold a JSON object: {path} is damaged; resume from another "
                              f"checkpoint")
    return state


def prune_checkpoints(output_dir: str, keep: int, saved_step: int) -> list[str]:
    """Keeps the checkpoint of `saved_step` and the keep - 1 newest before it; returns what was removed. Newer
    ones (there are none on the current line: a rollback moves them aside) are not this function's to judge, nor
    are folders that are not what their names say (complete_checkpoints leaves them out)."""
    older = [p for p in complete_checkpoints(output_dir) if folder_step(p) < saved_step]
    doomed = older[:max(0, len(older) - (keep - 1))]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def _attempt(action: Callable[[], None], rank: int, only_rank0: bool = False, root: str = "",
             need: Optional[int] = None) -> Optional[str]:
    """Runs `action` (on rank 0 only, if asked); returns its error as text instead of raising it. Any error: a full
    disk is an OSError in some writers and a RuntimeError in torch's zip writer."""
    if only_rank0 and rank != 0:
        return None
    try:
        action()
    except OSError as e:  # full disk, permissions (its errno says which): reported by every rank together
        return f"rank {rank}: {e}"
    except Exception as e:  # noqa: BLE001 - torch's "[enforce fail at inline_container.cc] unexpected pos", ...
        full = full_disk_note(root, need)
        if full:  # the disk is why: torch's zip writer's own words ("unexpected pos") say nothing to a user
            return f"rank {rank}: {full.removeprefix(' (').removesuffix(')')}"
        first = (str(e).strip().splitlines() or [""])[0]
        return f"rank {rank}: {type(e).__name__}: {first}"
    return None


def _agree(error: Optional[str], name: str, previous: Optional[str], tmp: str, rank: int) -> None:
    """Collective: every rank raises if any rank failed, naming the untouched previous checkpoint; the temporary
    folder goes, so that a full disk does not stay full."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    errors = [e for e in errors if e]
    if errors:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        kept = (f"the previous checkpoint {previous} is untouched" if previous else
                "it was this run's first, so no checkpoint of it exists yet")
        raise CheckpointError(f"saving checkpoint {name} failed ({'; '.join(errors)}); {kept}")


class _RecordedWrites:
    """During one DeepSpeed save, its writers (its checkpoint engine's `save`, and the copy of its recovery
    scripts; its `latest` file is not asked for) record their first error instead of raising it, and write nothing
    after it. DeepSpeed's save has collectives after its writes (a barrier): a rank whose write raised would skip
    them, and meet the others in our agreement instead, a mismatch that hangs. So every rank runs DeepSpeed's save
    to its end, then raises what was recorded. The checkpoint engine is DeepSpeed's pluggable writer; without one
    this fails loudly, naming the DeepSpeed version."""

    def __init__(self, engine):
        self.error: Optional[BaseException] = None
        writer = getattr(engine, "checkpoint_engine", None)
        if writer is None or not callable(getattr(writer, "save", None)):
            import deepspeed

            raise RuntimeError(f"deepspeed {deepspeed.__version__}: the engine has no checkpoint_engine.save, which "
                               f"checkpoint.py wraps to agree on a failed save (see _RecordedWrites)")
        self.wrapped = [(writer, "save")] + ([(engine, "_copy_recovery_script")]
                                             if callable(getattr(engine, "_copy_recovery_script", None)) else [])

    def __enter__(self) -> "_RecordedWrites":
        for owner, name in self.wrapped:
            setattr(owner, name, self._recorded(getattr(owner, name)))  # an instance attribute over the method
        return self

    def __exit__(self, *exc) -> None:
        for owner, name in self.wrapped:
            vars(owner).pop(name, None)

    def _recorded(self, write):
        def call(*args, **kwargs):
            if self.error is not None:
                return None
            try:
                return write(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - raised after DeepSpeed's save returns (class docstring)
                self.error = e
                return None
        return call


def _write_files(engine, tmp: str, step: int, trainer_state: dict, model_config, tokenizer, rank: int,
                 adapters=None, base_model: Optional[str] = None, arrays: Optional[dict] = None) -> None:
    with _RecordedWrites(engine) as writes:  # DeepSpeed's own `latest` is written below: its write is not recorded
        engine.save_checkpoint(tmp, tag="ds", save_latest=False, exclude_frozen_parameters=adapters is not None)
    if writes.error is not None:
        raise writes.error
    torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank_{rank}.pt"))
    inject_in_save(step, rank)
    if rank == 0:
        write_text_atomically(os.path.join(tmp, LATEST), "ds")  # for DeepSpeed's zero_to_fp32.py run in the folder
        write_text_atomically(os.path.join(tmp, TRAINER_STATE), json.dumps(trainer_state, indent=1))
        model_config.save_pretrained(os.path.join(tmp, "model"))
        if adapters is not None:
            from ...model.adapters import save_adapter_config

            save_adapter_config(adapters, os.path.join(tmp, "model"), base_model)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(os.path.join(tmp, "model"))
        # relative paths: DPO's reference log-probs (train/preference/reference_logps.py)
        for name, values in (arrays or {}).items():
            os.makedirs(os.path.dirname(os.path.join(tmp, name)), exist_ok=True)
            with open(os.path.join(tmp, name), "wb") as f:
                np.save(f, values)


def consolidated_state(folder: str) -> dict:
    """{parameter name: fp32 value} of a checkpoint's ZeRO shards, consolidated on the CPU (DeepSpeed's
    zero_to_fp32, loaded with weights_only), the `model.` prefix of the trainer's wrapper dropped."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with safe_loading():
        state = get_fp32_state_dict_from_zero_checkpoint(folder, tag="ds")
    return {k.removeprefix("model."): v for k, v in state.items()}


def write_peft_folder(folder: str) -> None:
    """PEFT's adapter files at the top of a --use_peft checkpoint (model/peft_files.py), from its consolidated fp32
    shards, so that `PeftModel.from_pretrained(base, <checkpoint>)` and vLLM's LoRA loader take the folder as it is."""
    from ...model.peft_files import write_adapter_folder

    write_adapter_folder(folder, folder, consolidated_state(folder))


def save_checkpoint(engine, output_dir: str, step: int, trainer_state: dict, model_config, tokenizer,
                    rank: int, total_limit: Optional[int] = None, adapters=None, base_model: Optional[str] = None,
                    arrays: Optional[dict] = None) -> str:
    """Collective: every rank calls it. Returns the final checkpoint path. `adapters` (model/adapters.py): save
    only what is trained, and the adapters' config (with `base_model`, the --model they were trained on). `arrays`:
    {relative path: numpy array} rank 0 writes too (in the manifest like every file). A save the
    free space cannot hold (the previous checkpoint's size: disk_space.py) is refused before anything is written;
    any failure while writing is agreed by every rank and raised as a CheckpointError naming the previous
    checkpoint."""
    root = checkpoints_dir(output_dir)
    name = checkpoint_name(step)
    final, tmp = os.path.join(root, name), os.path.join(root, f".tmp-{name}")
    previous = newest_complete(output_dir)
    need = checkpoint_bytes(previous)

    def prepare():
        os.makedirs(root, exist_ok=True)
        remove_stale_temporaries(root, ".tmp-")
        problem = too_little_space(root, need, f"the size of {os.path.basename(previous)}" if previous else "")
        if problem:
            raise OSError(errno.ENOSPC, problem)
        os.makedirs(os.path.join(tmp, "rng"))

    def publish():
        if adapters is not None:  # every rank's shards are written (agreed above): PEFT's folder from them
            write_peft_folder(tmp)
        write_manifest(tmp)
        write_text_atomically(os.path.join(tmp, COMPLETE), complete_marker(step))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        write_text_atomically(os.path.join(root, LATEST), name + "\n")

    _agree(_attempt(prepare, rank, True, root, need), name, previous, tmp, rank)
    _agree(_attempt(lambda: _write_files(engine, tmp, step, trainer_state, model_config, tokenizer, rank, adapters,
                                         base_model, arrays), rank, False, root, need), name, previous, tmp, rank)
    _agree(_attempt(publish, rank, True, root, need), name, previous, tmp, rank)
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
